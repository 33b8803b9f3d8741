"""POST /v1/snapshots/{tag}/compact and the /v1/workspaces routes through jupyter-server (jp_fetch).

Status codes, check order, bodies and WorkspaceInfo fields follow reference/forkd-api.md §4-6.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from forkd_server.app import EVENT_SCHEMA_ID

from .test_api import JSON, call

@pytest.fixture
def snap(forkd_app):
    return forkd_app.controller.create_snapshot("py", setup="x = 41")


class Saturated:
    """Every branch slot taken (as if 4 branches were in flight), for the 503 answers."""

    def __init__(self, ctl):
        self.ctl = ctl

    def __enter__(self):
        self.releases = [self.ctl.branches.take_slot(f"held-{i}") for i in range(self.ctl.branch_cap)]

    def __exit__(self, *exc):
        for release in self.releases:
            release()


# --- compact ------------------------------------------------------------------------------------

async def test_compact(jp_fetch, forkd_app, snap):
    code, info = await call(jp_fetch, "POST", "snapshots", "py", "compact", body={"to": "py2"})
    assert code == 200
    assert info["tag"] == "py2" and info["status"] == "ready" and info["bootable"] is True
    assert info["branched_from"] == "compact:py" and info["lineage"] == ["py2"] and "pause_ms" not in info
    code, detail = await call(jp_fetch, "GET", "snapshots", "py2", "info")
    assert code == 200 and detail["ancestors"] == [] and "parent_tag" not in detail
    assert await call(jp_fetch, "GET", "sandboxes") == (200, [])   # the helper sandbox is gone
    assert await call(jp_fetch, "DELETE", "snapshots", "py") == (204, b"")
    code, kids = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py2"})
    assert code == 201
    code, out = await call(jp_fetch, "POST", "sandboxes", kids[0]["id"], "eval", body={"code": "x + 1"})
    assert (code, out["result"]) == (200, "42")


async def test_compact_check_order(jp_fetch, forkd_app, snap):
    compact = ("snapshots", "py", "compact")
    code, body = await call(jp_fetch, "POST", *compact, body={})
    assert (code, body) == (422, {"error": "missing field `to`"})
    code, body = await call(jp_fetch, "POST", *compact, body={"to": "x"}, headers={"Content-Type": "text/plain"})
    assert code == 415
    code, body = await call(jp_fetch, "POST", "snapshots", "-bad", "compact", body={"to": "-worse"})
    assert code == 400 and body["error"].startswith("invalid tag '-bad'")
    code, body = await call(jp_fetch, "POST", "snapshots", "nope", "compact", body={"to": "-worse"})
    assert code == 400 and body["error"].startswith("invalid to '-worse'")
    code, body = await call(jp_fetch, "POST", "snapshots", "nope", "compact", body={"to": "nope"})
    assert code == 400 and "must differ" in body["error"]
    with Saturated(forkd_app.controller):
        code, body = await call(jp_fetch, "POST", "snapshots", "nope", "compact", body={"to": "py"})
        assert code == 503 and "concurrency" in body["error"]
    code, body = await call(jp_fetch, "POST", "snapshots", "nope", "compact", body={"to": "py"})
    assert (code, body) == (409, {"error": "snapshot py already exists; DELETE first"})
    code, body = await call(jp_fetch, "POST", "snapshots", "nope", "compact", body={"to": "fresh"})
    assert (code, body) == (404, {"error": "snapshot nope not found"})


# --- workspaces ---------------------------------------------------------------------------------

RUNNING_FIELDS = {"id", "name", "source_snapshot_tag", "status", "created_at_unix", "last_active_unix",
                  "memory_limit_mib", "live_sandbox_id"}


async def test_workspace_lifecycle(jp_fetch, forkd_app, snap):
    code, ws = await call(jp_fetch, "POST", "workspaces", body={"name": "w1", "snapshot_tag": "py",
                                                                "per_child_netns": False, "memory_limit_mib": 256})
    assert code == 201 and set(ws) == RUNNING_FIELDS
    sid = ws["live_sandbox_id"]
    assert ws["id"] == "ws-" + sid[:16] and ws["status"] == "running" and ws["source_snapshot_tag"] == "py"
    assert ws["memory_limit_mib"] == 256 and isinstance(ws["created_at_unix"], int)
    assert await call(jp_fetch, "GET", "workspaces") == (200, [ws])
    assert await call(jp_fetch, "GET", "workspaces", "w1") == (200, ws)
    await call(jp_fetch, "POST", "sandboxes", sid, "run", body={"code": "x = 'before suspend'"})

    code, info = await call(jp_fetch, "POST", "workspaces", "w1", "suspend", body={})
    assert code == 200 and info["status"] == "suspended" and info["current_state_tag"] == "ws-w1-state"
    assert set(info) == RUNNING_FIELDS - {"live_sandbox_id"} | {"current_state_tag"}
    assert (await call(jp_fetch, "GET", "sandboxes", sid))[0] == 404
    code, state = await call(jp_fetch, "GET", "snapshots", "ws-w1-state", "info")
    assert code == 200 and state["branched_from"] == sid

    r = await jp_fetch("forkd", "v1", "workspaces", "w1", "resume", method="POST", body=b"")  # no body, no type
    info = json.loads(r.body)
    assert r.code == 200 and info["status"] == "running" and info["id"] == ws["id"]
    code, out = await call(jp_fetch, "POST", "sandboxes", info["live_sandbox_id"], "eval", body={"code": "x"})
    assert out["result"] == "'before suspend'"
    code, sb = await call(jp_fetch, "GET", "sandboxes", info["live_sandbox_id"])
    assert sb["memory_limit_mib"] == 256 and sb["snapshot_tag"] == "ws-w1-state"

    await call(jp_fetch, "POST", "sandboxes", info["live_sandbox_id"], "run", body={"code": "x = 'second'"})
    code, again = await call(jp_fetch, "POST", "workspaces", "w1", "suspend", body={"diff": True})
    assert code == 200 and again["status"] == "suspended"
    code, snaps = await call(jp_fetch, "GET", "snapshots")
    assert sorted(s["tag"] for s in snaps) == ["py", "ws-w1-state"]      # replaced, not added
    code, body = await call(jp_fetch, "DELETE", "snapshots", "ws-w1-state")
    assert code == 409 and "workspace w1" in body["error"]

    assert await call(jp_fetch, "DELETE", "workspaces", "w1") == (204, b"")
    assert await call(jp_fetch, "GET", "workspaces") == (200, [])
    code, snaps = await call(jp_fetch, "GET", "snapshots")
    assert [s["tag"] for s in snaps] == ["py"]


async def test_workspace_create_check_order(jp_fetch, forkd_app, snap):
    code, body = await call(jp_fetch, "POST", "workspaces", body={"name": "w"})
    assert (code, body) == (422, {"error": "missing field `snapshot_tag`"})
    code, body = await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "py",
                                                                  "memory_limit_mib": "big"})
    assert code == 422
    code, body = await call(jp_fetch, "POST", "workspaces", body={"name": "a/b", "snapshot_tag": "-x"})
    assert code == 400 and body["error"].startswith("invalid name 'a/b'")
    code, body = await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "-x"})
    assert code == 400 and body["error"].startswith("invalid snapshot_tag '-x'")
    assert await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "nope"}) == \
        (404, {"error": "snapshot nope not found"})
    assert (await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "py"}))[0] == 201
    assert await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "py"}) == \
        (409, {"error": "workspace w already exists"})
    code, body = await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "-x"})
    assert code == 400  # the snapshot_tag is checked before the name's existence


async def test_unknown_workspace_is_404_everywhere(jp_fetch, forkd_app):
    missing = {"error": "workspace ghost not found"}
    assert await call(jp_fetch, "GET", "workspaces", "ghost") == (404, missing)
    assert await call(jp_fetch, "DELETE", "workspaces", "ghost") == (404, missing)
    assert await call(jp_fetch, "POST", "workspaces", "ghost", "suspend", body={"diff": True}) == (404, missing)
    assert await call(jp_fetch, "POST", "workspaces", "ghost", "resume") == (404, missing)


async def test_suspend_and_resume_check_order(jp_fetch, forkd_app, snap):
    ctl = forkd_app.controller
    code, ws = await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "py"})
    # the body is checked first (forkd's extractor), even for a missing workspace
    code, body = await call(jp_fetch, "POST", "workspaces", "ghost", "suspend", body="")
    assert code == 400 and "empty" in body["error"]
    code, body = await call(jp_fetch, "POST", "workspaces", "w", "suspend", body={"diff": "yes"})
    assert (code, body) == (422, {"error": "invalid type for field `diff`: expected boolean"})
    assert await call(jp_fetch, "POST", "workspaces", "w", "resume") == \
        (400, {"error": "workspace w is already running"})
    ctl.workspaces._acquire("w", "resume")
    try:
        code, body = await call(jp_fetch, "POST", "workspaces", "w", "suspend", body={})
        assert code == 409 and "busy" in body["error"]
        code, body = await call(jp_fetch, "DELETE", "workspaces", "w")
        assert code == 409
    finally:
        ctl.workspaces._release("w")
    with Saturated(ctl):
        code, body = await call(jp_fetch, "POST", "workspaces", "w", "suspend", body={})
        assert code == 503 and "concurrency" in body["error"]
    # its sandbox killed through the sandbox API: the workspace reads stale, suspend is 400
    assert (await call(jp_fetch, "DELETE", "sandboxes", ws["live_sandbox_id"]))[0] == 204
    code, info = await call(jp_fetch, "GET", "workspaces", "w")
    assert info["status"] == "stale" and "live_sandbox_id" not in info
    assert await call(jp_fetch, "POST", "workspaces", "w", "suspend", body={}) == \
        (400, {"error": "workspace w is not running (status stale)"})
    code, info = await call(jp_fetch, "POST", "workspaces", "w", "resume")
    assert code == 200 and info["status"] == "running"
    assert (await call(jp_fetch, "POST", "workspaces", "w", "suspend", body={}))[0] == 200
    assert await call(jp_fetch, "POST", "workspaces", "w", "suspend", body={}) == \
        (400, {"error": "workspace w is not running (status suspended)"})


async def test_workspace_events_reach_the_event_bus(jp_serverapp, forkd_app, snap):
    """The change schema accepts workspace events (jupyter_events drops events it does not)."""
    got: list[dict] = []
    arrived = asyncio.Event()

    async def listener(logger, schema_id, data):
        if data.get("kind") == "workspace":
            got.append(data)
            if data["action"] == "deleted":
                arrived.set()

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA_ID, listener=listener)
    ctl = forkd_app.controller
    for step in (lambda: ctl.create_workspace("ev", "py"), lambda: ctl.suspend_workspace("ev"),
                 lambda: ctl.resume_workspace("ev"), lambda: ctl.delete_workspace("ev")):
        await asyncio.to_thread(step)
    await asyncio.wait_for(arrived.wait(), 10)
    assert [(e["action"], e.get("status")) for e in got] == \
        [("created", "running"), ("suspended", "suspended"), ("resumed", "running"), ("deleted", None)]
    assert all(e["name"] == "ev" for e in got)
    assert got[1]["current_state_tag"] == "ws-ev-state"
