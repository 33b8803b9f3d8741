"""The MCP tools ``freeze_sandbox``, ``store_sandbox`` and ``wake_sandbox`` through the mcp SDK's
in-memory client, on real process-engine sandboxes in a real ``jupyter server``: a sandbox frozen
and woken keeps its state; what cannot be done is a tool error saying what to do in the tools'
own words (storing needs the VM engine: tests/vm/test_vm_mcp_tiers.py stores and wakes one)."""

from __future__ import annotations

import pytest

pytest.importorskip("mcp.server.mcpserver")  # mcp 2.x (forkd_server.mcp.SUPPORTED)

import anyio  # noqa: E402
from mcp import Client  # noqa: E402

from forkd_server.mcp import build_server  # noqa: E402

from .test_mcp import ctl, data, failure, jupyter, run  # noqa: E402,F401 - this module's own fixtures


def test_freeze_then_wake_keeps_the_state_and_store_says_to_freeze(ctl):  # noqa: F811
    ctl.create_snapshot("mcp-tier", setup="x = 41")

    async def scenario():
        async with Client(build_server(ctl)) as c:
            tools = {t.name: t for t in (await c.list_tools()).tools}
            sid = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": "mcp-tier"}))[0]["id"]
            await c.call_tool("run_cell", {"sandbox_id": sid, "code": "x += 1"})
            frozen = data(await c.call_tool("freeze_sandbox", {"sandbox_id": sid}))
            again = data(await c.call_tool("freeze_sandbox", {"sandbox_id": sid}))  # answered as it is
            listed = data(await c.call_tool("get_sandbox", {"sandbox_id": sid}))  # a GET wakes nothing
            no_store = failure(await c.call_tool("store_sandbox", {"sandbox_id": sid}))
            woke = data(await c.call_tool("wake_sandbox", {"sandbox_id": sid}))
            value = data(await c.call_tool("eval_code", {"sandbox_id": sid, "code": "x"}))
            # a move down while a cell runs in it is refused, saying what to do
            started = anyio.Event()

            async def on_progress(done, total, message):
                started.set()

            async def long_cell():
                await c.call_tool("run_cell", {"sandbox_id": sid, "code": (
                    "import time\nprint('running', flush=True)\nfor _ in range(600):\n    time.sleep(0.1)")},
                    progress_callback=on_progress)

            async with anyio.create_task_group() as tg:
                tg.start_soon(long_cell)
                await started.wait()
                busy = failure(await c.call_tool("freeze_sandbox", {"sandbox_id": sid}))
                tg.cancel_scope.cancel()  # the cell is interrupted
            gone = failure(await c.call_tool("wake_sandbox", {"sandbox_id": "sb-nope"}))
            await c.call_tool("kill_sandbox", {"sandbox_id": sid})
            return locals()

    try:
        r = run(scenario())
    finally:
        for sb in ctl.list_sandboxes():
            if "mcp-tier" in sb["lineage"]:
                ctl.kill_sandbox(sb["id"])
        ctl.delete_snapshot("mcp-tier")
    for name in ("freeze_sandbox", "store_sandbox", "wake_sandbox"):  # nothing destroyed, the same twice
        annotations = r["tools"][name].annotations
        assert not annotations.destructive_hint and not annotations.read_only_hint and annotations.idempotent_hint
    assert r["frozen"]["tier"] == "frozen" and r["again"]["tier"] == "frozen" and r["listed"]["tier"] == "frozen"
    assert r["no_store"].startswith(f"Error executing tool store_sandbox: sandbox {r['sid']} runs on the process "
                                    f"engine, whose deepest tier is frozen")
    assert r["no_store"].endswith(f"\nfreeze_sandbox {r['sid']} instead, or store sandboxes of a snapshot made with "
                                  f"create_snapshot engine='vm'")
    assert r["woke"]["tier"] == "running" and r["woke"]["wake"]["from"] == "frozen"
    assert r["value"]["result"] == "42"  # its state, through the freeze and the wake
    assert "is running" in r["busy"] and r["busy"].endswith(
        "\nretry once the call running in it has returned (cancelling a run_cell interrupts its cell)")
    assert "sb-nope" in r["gone"] and "list_sandboxes" in r["gone"]
