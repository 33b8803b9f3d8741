"""Fork trees for agents: ``fork_sandbox`` (N copies of a running sandbox, one tree) and
``promote_sandbox`` (keep the copy that worked, kill the rest), each one REST route through the SDK."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer

from ..client import Controller
from ._errors import explained
from ._forkd_tools import CREATES, DESTROYS


def register(server: MCPServer, ctl: Controller) -> None:

    @server.tool(annotations=CREATES)
    @explained("fork_sandbox")
    def fork_sandbox(sandbox_id: str, count: int = 3, tag: str | None = None, memory_limit_mib: int | None = None,
                     lossy: bool = False) -> dict[str, Any]:
        """``count`` copies of a running sandbox as it is now (a notebook's HEAD, list_notebooks, works
        too): it is branched once (a pause of a few ms) and the copies forked from that branch, all in
        one fork tree. Returns ``fork_tree_id``, the branch ``snapshot`` and the ``sandboxes``. Try one
        change in each (run_cell), then promote_sandbox the one that worked. ``tag`` names the branch
        (a snapshot with your tag is never released); ``lossy`` forks even if running threads or
        processes stay behind."""
        return ctl.fork_sandbox(sandbox_id, count, tag=tag, memory_limit_mib=memory_limit_mib, lossy=lossy)

    @server.tool(annotations=DESTROYS)
    @explained("promote_sandbox")
    def promote_sandbox(sandbox_id: str, tree_id: str | None = None, cleanup_siblings: bool = True) -> dict[str, Any]:
        """Keep ``sandbox_id``, the winner of its fork tree (``tree_id``: default, its own): its
        siblings are killed (their state is gone) and the tree's snapshot is released if nothing
        needs it. A sibling a notebook runs in or took over, a workspace's, or a snapshot with a
        user's tag is never touched: ``kept`` says what stayed and why. Returns ``killed``,
        ``released``, ``kept``, ``failed`` and the ``winner``'s info."""
        return ctl.promote_sandbox(sandbox_id, tree_id, cleanup_siblings=cleanup_siblings)
