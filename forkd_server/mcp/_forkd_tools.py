"""forkd-mcp's eleven tools, with its names, parameters and defaults, so a prompt written for forkd
works here; plus ``delete_snapshot`` (as sandstorm-mcp has it). Each maps onto one REST route
through the SDK, as forkd-mcp's do (inside the forkd server, eval_code and ping_sandbox make that
route's call on its controller: ``_in_process``); long ones report progress."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

from ..client import Controller
from ._errors import Refused, explained
from ._progress import Following, run_reporting
from ._threads import off_loop

if TYPE_CHECKING:  # the in-process calls import the server's handlers: never in `forkd mcp`
    from ._in_process import InProcess

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
CREATES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
RUNS_CODE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                            open_world_hint=False)
DESTROYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)
TAIL_BYTES = 4096  # what wait_for_text reads of the file each time, as forkd-mcp does


def register(server: MCPServer, ctl: Controller, quick: InProcess | None = None) -> None:
    """``quick``: where eval_code, exec_command and ping_sandbox go when the MCP server lives in the
    forkd server (its own controller, no second request back into it); else they go through ``ctl``."""

    @server.tool(annotations=READ_ONLY)
    @explained("list_snapshots")
    def list_snapshots() -> list[dict[str, Any]]:
        """Every snapshot (a frozen, warmed-up interpreter sandboxes are forked from): tag, status
        (writing, ready, failed), branched_from, engine, labels."""
        return ctl.list_snapshots()

    @server.tool(annotations=CREATES)
    @explained("spawn_sandboxes")
    async def spawn_sandboxes(snapshot_tag: str, n: int = 1, per_child_netns: bool = False,
                              memory_limit_mib: int = 256, prewarm: bool = False, live_fork: bool = False,
                              ctx: Context | None = None) -> list[dict[str, Any]]:
        """Fork ``n`` copy-on-write sandboxes from snapshot ``snapshot_tag`` (each starts with the
        snapshot's whole state); returns their infos (``id`` names each in the other tools).
        Reports progress as each child starts."""
        return await spawn_reporting(ctl, ctx, snapshot_tag, n, per_child_netns=per_child_netns,
                                     memory_limit_mib=memory_limit_mib, prewarm=prewarm, live_fork=live_fork)

    @server.tool(annotations=CREATES)
    @explained("branch_sandbox")
    def branch_sandbox(sandbox_id: str, tag: str | None = None, diff: bool = False, measure_diff: bool = False,
                       mode: str | None = None, wait: bool = True) -> dict[str, Any]:
        """Turn a running sandbox into a new snapshot (it keeps running; its pause is a few ms with
        ``mode="live"``). ``mode``: full, diff or live; ``wait=False`` answers while the snapshot is
        still ``writing``. Fork the snapshot with spawn_sandboxes."""
        return ctl.branch_sandbox(sandbox_id, tag, diff=diff, measure_diff=measure_diff, mode=mode, wait=wait)

    @server.tool(annotations=CREATES)
    @explained("create_snapshot")
    def create_snapshot(tag: str, kernel: str | None = None, rootfs: str | None = None, rw: bool = False,
                        tap: str | None = None, boot_wait_secs: int = 10, setup: str | None = None,
                        engine: str = "auto", packages: list[str] | None = None) -> dict[str, Any]:
        """Create a snapshot. forkd's form: ``kernel`` and ``rootfs`` (paths on the server's host)
        boot a VM. This server's form: ``setup``, Python run once, whose state every sandbox forked
        from the snapshot starts with (``engine``: process, vm or auto; ``packages``: Debian
        packages for a VM). ``rw`` and ``tap`` are accepted as forkd's tool takes them; this server
        keeps each child's disk its own and gives sandboxes no network."""
        if (kernel is None) != (rootfs is None):
            raise Refused("kernel and rootfs go together (forkd's VM form)",
                          "give both, or neither and a Python `setup` instead")
        info = ctl.create_snapshot(tag, setup=setup, engine=engine, packages=packages, kernel=kernel, rootfs=rootfs,
                                   boot_wait_secs=boot_wait_secs if kernel else None)
        if rw or tap:
            info.setdefault("notes", []).append("rw and tap were accepted but have no effect here: each child's "
                                                "disk is its own copy and sandboxes have no network")
        return info

    @server.tool(annotations=READ_ONLY)
    @explained("wait_for_text")
    def wait_for_text(sandbox_id: str, path: str, marker: str, timeout_secs: float = 60,
                      poll_interval_ms: int = 200) -> dict[str, Any]:
        """Wait until ``marker`` appears in the last 4 KiB of the file ``path`` in the sandbox (a
        log a background job writes); returns how long it took and the file's tail."""
        if timeout_secs <= 0 or poll_interval_ms <= 0:
            raise Refused("timeout_secs and poll_interval_ms must be positive",
                          "e.g. timeout_secs=60, poll_interval_ms=200")
        start = time.monotonic()
        while True:
            reply = ctl.exec_command(sandbox_id, ["tail", "-c", str(TAIL_BYTES), path], 30)
            tail = reply.get("stdout", "")
            waited = time.monotonic() - start
            if marker in tail:
                return {"sandbox_id": sandbox_id, "path": path, "found": True,
                        "elapsed_secs": round(waited, 3), "tail": tail}
            if waited >= timeout_secs:
                said = (reply.get("stderr") or "").strip() or f"its last {TAIL_BYTES} bytes do not hold it"
                raise Refused(f"{marker!r} did not appear in {path} in {sandbox_id} within "
                              f"{timeout_secs:g} s ({said})",
                              "check that the job writing it runs (exec_command ps), or wait longer")
            time.sleep(min(poll_interval_ms / 1000, max(0.0, timeout_secs - waited)))  # the poll interval asked for

    @server.tool(annotations=READ_ONLY)
    @explained("list_sandboxes")
    def list_sandboxes() -> list[dict[str, Any]]:
        """Every running sandbox: id, snapshot_tag, engine, labels, memory limit."""
        return ctl.list_sandboxes()

    @server.tool(annotations=READ_ONLY)
    @explained("get_sandbox")
    def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        """One running sandbox's info (404 says how it ended if it did)."""
        return ctl.get_sandbox(sandbox_id)

    @server.tool(annotations=DESTROYS)
    @explained("kill_sandbox")
    def kill_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Kill a sandbox: its state is gone, except what branches of it keep."""
        ctl.kill_sandbox(sandbox_id)
        return {"id": sandbox_id, "killed": True}

    @server.tool(annotations=DESTROYS)
    @explained("delete_snapshot")
    def delete_snapshot(tag: str, cascade: bool = False) -> dict[str, Any]:
        """Delete a snapshot; ``cascade`` also deletes the snapshots branched from it and kills
        their sandboxes (without it, a snapshot something depends on is refused, naming what)."""
        ctl.delete_snapshot(tag, cascade=cascade)
        return {"tag": tag, "deleted": True}

    @server.tool(annotations=RUNS_CODE)
    @explained("exec_command")
    async def exec_command(sandbox_id: str, args: list[str], timeout_secs: int = 30) -> dict[str, Any]:
        """Run a command (argv list, no shell: use ["sh", "-c", "..."] for one) in the sandbox;
        returns stdout, stderr and exit_code (a non-zero exit is a result, not an error)."""
        if not args:
            raise Refused("args is empty", 'give the command as a list, e.g. ["ls", "-l", "/tmp"]')
        if quick is not None:
            return await quick.exec_command(sandbox_id, args, timeout_secs)
        return await off_loop(ctl.exec_command)(sandbox_id, args, timeout_secs)

    @server.tool(annotations=RUNS_CODE)
    @explained("eval_code")
    async def eval_code(sandbox_id: str, code: str) -> dict[str, Any]:
        """Evaluate one Python expression in the sandbox's persistent namespace; its repr comes back
        as ``result`` (a failure as ``error``). For statements, printed and rich output: run_cell."""
        if quick is not None:
            return await quick.eval_code(sandbox_id, code)
        return await off_loop(ctl.eval_code)(sandbox_id, code)

    @server.tool(annotations=READ_ONLY)
    @explained("ping_sandbox")
    async def ping_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Check that the sandbox's agent answers."""
        if quick is not None:
            return await quick.ping_sandbox(sandbox_id)
        return await off_loop(ctl.ping_sandbox)(sandbox_id)


async def spawn_reporting(ctl: Controller, ctx: Context | None, snapshot_tag: str, n: int, *, done: int = 0,
                          **options) -> list[dict[str, Any]]:
    """``spawn_sandboxes`` with one progress notification per child as the server starts it (its
    ``created`` event); ``done``: steps reported before it (the total is theirs plus ``n``)."""

    def work(say) -> list[dict[str, Any]]:
        seen: set[str] = set()

        def step(event: dict) -> str | None:
            if (event.get("kind"), event.get("action")) == ("sandbox", "created") \
                    and event.get("snapshot_tag") == snapshot_tag:
                seen.add(event.get("id"))
                return f"{event.get('id')} started ({min(len(seen), n)} of {n})"
            return None

        with Following(ctl, say, step) as events:
            kids = ctl.spawn_sandboxes(snapshot_tag, n, **options)
            events.settle(lambda: {k["id"] for k in kids} <= seen)
            return kids

    return await run_reporting(ctx, work, total=done + n, done=done)
