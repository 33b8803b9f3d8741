"""The MCP tools ``fork_sandbox`` and ``promote_sandbox`` through the mcp SDK's in-memory client, on
real sandboxes in a real ``jupyter server``: an agent forks a sandbox, keeps the copy that worked
and its siblings go; it forks a live notebook's HEAD, checks its pick out into the notebook and
promotes it."""

from __future__ import annotations

import pytest

pytest.importorskip("mcp.server.mcpserver")  # mcp 2.x (forkd_server.mcp.SUPPORTED)

from mcp import Client  # noqa: E402

from forkd_server.mcp import build_server  # noqa: E402

from .test_mcp import ctl, data, failure, jupyter, notebook, run  # noqa: E402,F401 - this module's own fixtures


def test_fork_then_promote_a_sandbox(ctl):  # noqa: F811
    ctl.create_snapshot("mcp-ft", setup="x = 41")
    parent = ctl.spawn_sandboxes("mcp-ft", 1)[0]["id"]
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, total, message))

    async def scenario():
        async with Client(build_server(ctl)) as c:
            tools = {t.name: t for t in (await c.list_tools()).tools}
            tree = data(await c.call_tool("fork_sandbox", {"sandbox_id": parent, "count": 3},
                                          progress_callback=on_progress))
            kids = [k["id"] for k in tree["sandboxes"]]
            for i, sb in enumerate(kids):
                await c.call_tool("run_cell", {"sandbox_id": sb, "code": f"x += {i}"})
            kept = data(await c.call_tool("promote_sandbox", {"sandbox_id": kids[1]}))
            value = data(await c.call_tool("eval_code", {"sandbox_id": kids[1], "code": "x"}))
            lost = failure(await c.call_tool("get_sandbox", {"sandbox_id": kids[0]}))
            none = failure(await c.call_tool("promote_sandbox", {"sandbox_id": parent}))
            zero = failure(await c.call_tool("fork_sandbox", {"sandbox_id": parent, "count": 0}))
            return locals()

    try:
        r = run(scenario())
    finally:
        for sb in ctl.list_sandboxes():  # the parent and what was forked from it
            if "mcp-ft" in sb["lineage"]:
                ctl.kill_sandbox(sb["id"])
        ctl.delete_snapshot("mcp-ft")
    assert r["tools"]["promote_sandbox"].annotations.destructive_hint
    assert not r["tools"]["fork_sandbox"].annotations.destructive_hint
    assert len(r["kids"]) == 3 and r["tree"]["fork_tree_id"].startswith("ft-")
    # the branch, then each copy as it started: progress only ever grows, towards count + 1
    assert [p for p, _, _ in progress] == [0, 1, 2, 3, 4] and {t for _, t, _ in progress} == {4}
    assert progress[1][2].startswith(f"branched as {r['tree']['snapshot']['tag']}")
    assert sum("started" in m for _, _, m in progress) == 3
    assert sorted(r["kept"]["killed"]) == sorted([r["kids"][0], r["kids"][2]])
    assert r["kept"]["released"] == [r["tree"]["snapshot"]["tag"]]
    assert r["value"]["result"] == "42"  # the state before the fork, and the winner's own change
    assert f"lost fork tree {r['tree']['fork_tree_id']}" in r["lost"]
    assert r["none"].startswith("Error executing tool promote_sandbox: sandbox ") and "no open fork tree" in r["none"]
    assert "count" in r["zero"] and "at least 1" in r["zero"]


def test_fork_a_notebook_check_the_pick_out_and_promote_it(ctl, notebook):  # noqa: F811
    kid = notebook["kernel_id"]

    async def scenario():
        async with Client(build_server(ctl)) as c:
            tree = data(await c.call_tool("fork_sandbox", {"sandbox_id": notebook["head"], "count": 3}))
            kids = [k["id"] for k in tree["sandboxes"]]
            cells = [await c.call_tool("run_cell", {"sandbox_id": sb, "code": f"answer += {i}\nanswer"})
                     for i, sb in enumerate(kids)]
            pick = next(sb for sb, cell in zip(kids, cells) if cell.structured_content["result"] == "42")
            moved = data(await c.call_tool("notebook_checkout", {"notebook": "agent.ipynb", "sandbox_id": pick}))
            kept = data(await c.call_tool("promote_sandbox", {"sandbox_id": pick}))
            back = data(await c.call_tool("notebook_checkout", {"notebook": kid, "sandbox_id": notebook["head"]}))
            await c.call_tool("kill_sandbox", {"sandbox_id": pick})
            return locals()

    r = run(scenario())
    assert all(k["labels"]["jupyter.notebook"] == "agent.ipynb" for k in r["tree"]["sandboxes"])  # the notebook's
    assert r["moved"]["head"] == r["pick"]
    assert sorted(r["kept"]["killed"]) == sorted(set(r["kids"]) - {r["pick"]})
    assert r["kept"]["winner"]["id"] == r["pick"] and r["back"]["head"] == notebook["head"]
    assert {sb["id"] for sb in ctl.list_sandboxes()} & set(r["kids"]) == set()
