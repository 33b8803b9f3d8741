"""What the JupyterLab panel reads from /v1/tree: each node's lineage, and every sandbox's memory
and busy state in one request (``?memory=true&busy=true``)."""

from __future__ import annotations

import asyncio

from .test_api import call, sandbox, snap  # noqa: F401 - fixtures


async def busy_of(jp_fetch, sandbox_id: str):
    _, nodes = await call(jp_fetch, "GET", "tree", params={"busy": "true"})
    return next(n["busy"] for n in nodes if n["id"] == sandbox_id)


async def test_tree_carries_lineage_and_memory_on_request(jp_fetch, forkd_app, sandbox):  # noqa: F811
    ctl = forkd_app.controller
    branch = ctl.branch(sandbox["id"], tag="tb", mode="full")
    ctl.kill_sandbox(sandbox["id"])  # the branch's parent is gone: its lineage still names it
    kid = ctl.spawn("tb", 1)[0]
    code, nodes = await call(jp_fetch, "GET", "tree")
    assert code == 200
    by_id = {n["id"]: n for n in nodes}
    assert by_id["tb"]["parent"] == sandbox["id"] and sandbox["id"] not in by_id
    assert by_id["tb"]["lineage"] == ["py", sandbox["id"], "tb"] == branch["lineage"]
    assert by_id[kid["id"]]["lineage"] == ["py", sandbox["id"], "tb", kid["id"]]
    assert "memory" not in by_id[kid["id"]]

    code, nodes = await call(jp_fetch, "GET", "tree", params={"memory": "true"})
    assert code == 200
    mem = {n["id"]: n.get("memory") for n in nodes}
    assert mem[kid["id"]]["uss_kib"] > 0 and mem[kid["id"]]["rss_kib"] >= mem[kid["id"]]["uss_kib"]
    assert "memory" not in {k for n in nodes if n["kind"] == "snapshot" for k in n}

    # idle says None; a loaded host may let the tree's 1 s ping run out ("not answering"): asked again
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        code, nodes = await call(jp_fetch, "GET", "tree", params={"memory": "true", "busy": "true"})
        busy = {n["id"]: n.get("busy", "absent") for n in nodes if n["kind"] == "sandbox"}
        assert code == 200 and set(busy) == {kid["id"]}, busy
        if busy[kid["id"]] is None:
            break
        assert busy[kid["id"]].startswith("not answering"), busy
        assert asyncio.get_running_loop().time() < deadline, f"the idle sandbox never showed idle: {busy}"
    # while a cell runs, the sandbox says what it runs; the cell runs until interrupted, so a
    # loaded host that starts it late or answers the tree slowly cannot miss it
    loop = asyncio.get_running_loop()
    cell = loop.run_in_executor(None, ctl.run_code, kid["id"], "import time\ntime.sleep(60)")
    deadline = loop.time() + 30
    while (busy := await busy_of(jp_fetch, kid["id"])) != "a cell":  # not None, nor a ping that timed out
        assert loop.time() < deadline, f"the tree never showed the cell running (busy: {busy!r})"
        await asyncio.sleep(0.02)
    assert (await call(jp_fetch, "POST", "sandboxes", kid["id"], "interrupt"))[1]["interrupted"] is True
    assert (await cell)["error"]["ename"] == "KeyboardInterrupt"

    code, body = await call(jp_fetch, "GET", "tree", params={"memory": "yes"})
    assert code == 400 and "memory" in body["error"]


async def test_frozen_agents_show_as_not_answering_and_never_hold_a_control_thread(jp_fetch, forkd_app, snap):  # noqa: F811
    """?busy=true pings every sandbox: frozen agents (SIGSTOP) answer nothing. Each ping gives up
    after a second, on the probe pool: the tree says so, and control calls answer meanwhile."""
    import os
    import signal
    import time

    ctl = forkd_app.controller
    kids = ctl.spawn("py", 4)
    frozen = kids[:3]
    for k in frozen:
        os.kill(k["pid"], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while True:
            t0 = time.monotonic()
            tree = asyncio.ensure_future(call(jp_fetch, "GET", "tree", params={"busy": "true"}))
            listing = await call(jp_fetch, "GET", "sandboxes")  # a control call, while the pings wait
            assert listing[0] == 200 and len(listing[1]) == 4
            code, nodes = await tree
            took = time.monotonic() - t0
            assert code == 200
            busy = {n["id"]: n["busy"] for n in nodes if n["kind"] == "sandbox"}
            for k in frozen:
                assert busy[k["id"]].startswith("not answering: no reply to a ping within 1 s"), busy
            assert took < 10, took                           # bounds a hang only (5 s a ping before, 1 s now)
            assert forkd_app.admission.control_running == 0
            if busy[kids[3]["id"]] is None:                  # the one that answers is idle
                break
            # a loaded host may let even its 1 s ping run out: asked again
            assert busy[kids[3]["id"]].startswith("not answering") and time.monotonic() < deadline, busy
    finally:
        for k in frozen:
            os.kill(k["pid"], signal.SIGCONT)


async def test_the_busy_column_never_wakes_a_sandbox_frozen_since_the_listing(jp_fetch, forkd_app, sandbox,  # noqa: F811
                                                                             monkeypatch):
    """The lab panel re-reads ``?busy=true`` while a user freezes a sandbox: a listing taken just
    before the freeze still says ``running``, and its ping must not wake the sandbox again."""
    ctl = forkd_app.controller
    sid = sandbox["id"]
    listed = ctl.tree()  # the listing, taken while the sandbox runs
    assert next(n for n in listed if n["id"] == sid)["tier"] == "running"
    ctl.freeze_sandbox(sid)
    monkeypatch.setattr(ctl, "tree", lambda *args, **kwargs: [dict(n) for n in listed])
    assert await busy_of(jp_fetch, sid) is None
    assert ctl.get_sandbox(sid)["tier"] == "frozen"
    monkeypatch.undo()
    assert (await call(jp_fetch, "POST", "sandboxes", sid, "wake"))[0] == 200
