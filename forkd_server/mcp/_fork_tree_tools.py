"""Fork trees for agents: ``fork_sandbox`` (N copies of a running sandbox, one tree) and
``promote_sandbox`` (keep the copy that worked, kill the rest), each one REST route through the SDK.
``notebook_fork`` (_notebook_tools.py) is ``fork_sandbox`` of a notebook's HEAD, through
``fork_reporting`` here."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context, MCPServer

from ..client import Controller
from ._errors import explained
from ._forkd_tools import CREATES, DESTROYS
from ._progress import Following, run_reporting


def register(server: MCPServer, ctl: Controller) -> None:

    @server.tool(annotations=CREATES)
    @explained("fork_sandbox")
    async def fork_sandbox(sandbox_id: str, count: int = 3, tag: str | None = None,
                           memory_limit_mib: int | None = None, lossy: bool = False,
                           ctx: Context | None = None) -> dict[str, Any]:
        """``count`` copies of a running sandbox as it is now (a notebook's HEAD, list_notebooks, works
        too): it is branched once (a pause of a few ms) and the copies forked from that branch, all in
        one fork tree. Returns ``fork_tree_id``, the branch ``snapshot`` and the ``sandboxes``. Try one
        change in each (run_cell), then promote_sandbox the one that worked. ``tag`` names the branch
        (a snapshot with your tag is never released); ``lossy`` forks even if running threads or
        processes stay behind. Reports progress: the branch, then each copy as it starts."""
        return await fork_reporting(ctl, ctx, sandbox_id, count, tag=tag, memory_limit_mib=memory_limit_mib,
                                    lossy=lossy)

    @server.tool(annotations=DESTROYS)
    @explained("promote_sandbox")
    def promote_sandbox(sandbox_id: str, tree_id: str | None = None, cleanup_siblings: bool = True) -> dict[str, Any]:
        """Keep ``sandbox_id``, the winner of its fork tree (``tree_id``: default, its own): its
        siblings are killed (their state is gone) and the tree's snapshot is released if nothing
        needs it. A sibling a notebook runs in or took over, a workspace's, or a snapshot with a
        user's tag is never touched: ``kept`` says what stayed and why. Returns ``killed``,
        ``released``, ``kept``, ``failed`` and the ``winner``'s info."""
        return ctl.promote_sandbox(sandbox_id, tree_id, cleanup_siblings=cleanup_siblings)


async def fork_reporting(ctl: Controller, ctx: Context | None, sandbox_id: str, count: int, *,
                         tag: str | None = None, **options) -> dict[str, Any]:
    """``POST /v1/sandboxes/{id}/fork`` with progress: ``branching`` (0), the branch (1), then one
    notification per copy as the server starts it (``count + 1`` in all), from the server's events."""
    if ctx is not None:
        await ctx.report_progress(0, count + 1, message=f"branching {sandbox_id}")

    def work(say) -> dict[str, Any]:
        branch: dict[str, str] = {}
        seen: set[str] = set()

        def step(event: dict) -> str | None:
            what = (event.get("kind"), event.get("action"))
            name = event.get("tag", "")
            # the tree's branch: the caller's tag, else the tree's id (ft-...), which the server names it by
            if what == ("snapshot", "created") and not branch and event.get("branched_from") == sandbox_id \
                    and (name == tag if tag is not None else name.startswith("ft-")):
                branch["tag"] = name
                return f"branched as {name} (paused {event.get('pause_ms')} ms)"
            if what == ("sandbox", "created") and branch and event.get("snapshot_tag") == branch["tag"]:
                seen.add(event.get("id"))
                return f"{event.get('id')} started ({min(len(seen), count)} of {count})"
            return None

        with Following(ctl, say, step) as events:
            tree = ctl.fork_sandbox(sandbox_id, count, tag=tag, **options)
            events.settle(lambda: {k["id"] for k in tree["sandboxes"]} <= seen)
            return tree

    return await run_reporting(ctx, work, total=count + 1)
