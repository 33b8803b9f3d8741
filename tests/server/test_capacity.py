"""A host's capacity, as a fleet's router reads it: the sandbox cap (``max_sandboxes``: a spawn past
it is refused whole, 503) and the ``capacity`` block of ``/healthz`` (its exact names and types)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from forkd_engine.cgroups import locate
from forkd_server.serve import ServeError, build_argv

from .test_api import call

CAP = 3
BLOCK = {"memory_free", "sandboxes", "max_sandboxes", "snapshots", "load"}


@pytest.fixture
def jp_server_config(forkd_data_dir):
    return {
        "ServerApp": {
            "jpserver_extensions": {"forkd_server": True, "jupyter_server_terminals": False},
            "allow_unauthenticated_access": False,
        },
        "ForkdApp": {"data_dir": forkd_data_dir, "max_sandboxes": CAP},
    }


@pytest.fixture
def snap(forkd_app):
    return forkd_app.controller.create_snapshot("cap", setup="x = 1")


async def health(jp_fetch) -> dict:
    r = await jp_fetch("forkd", "healthz")  # with the server's token: a probe without one gets no figures
    return json.loads(r.body)


async def test_healthz_without_a_token_says_up_and_nothing_of_the_load(jp_fetch, forkd_app):
    r = await jp_fetch("forkd", "healthz", headers={"Authorization": ""})
    assert json.loads(r.body) == {"ok": True}


async def spawn(jp_fetch, n):
    return await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "cap", "n": n})


async def listed(jp_fetch) -> list[str]:
    code, body = await call(jp_fetch, "GET", "sandboxes")
    assert code == 200
    return [s["id"] for s in body]


def assert_full(code, body, n, held):
    assert code == 503, body
    assert isinstance(body["error"], str)
    first, hint = body["error"].split("\n")
    assert f"spawn of {n} from cap refused" in first and f"its cap is {CAP} (--max-sandboxes)" in first
    assert "nothing was started" in first and "kill sandboxes" in hint
    assert body["capacity"] == {"sandboxes": held, "max_sandboxes": CAP, "requested": n}
    assert body["details"]["room"] == max(0, CAP - held)


async def test_capacity_block_names_and_types(jp_fetch, forkd_app):
    body = await health(jp_fetch)
    assert set(body) == {"ok", "capacity"} and body["ok"] is True
    block = body["capacity"]
    assert set(block) == BLOCK
    assert type(block["memory_free"]) is int and block["memory_free"] > 0
    assert type(block["load"]) is float and block["load"] >= 0
    assert (block["sandboxes"], block["max_sandboxes"], block["snapshots"]) == (0, CAP, 0)
    forkd_app.controller.create_snapshot("cap", setup="x = 1")
    kids = forkd_app.controller.spawn("cap", 2)
    block = (await health(jp_fetch))["capacity"]
    assert (block["sandboxes"], block["snapshots"]) == (2, 1)
    assert all(type(block[k]) is int for k in ("sandboxes", "max_sandboxes", "snapshots"))
    forkd_app.controller.kill_sandbox(kids[0]["id"])
    assert (await health(jp_fetch))["capacity"]["sandboxes"] == 1


async def test_the_answers_match_openapi_json(jp_fetch, forkd_app, snap):
    """/healthz and the cap's 503 as the document describes them (its schemas, unknown fields of
    the capacity block refused)."""
    import jsonschema

    from forkd_server.handlers import OPENAPI_PATH

    with open(OPENAPI_PATH) as f:
        doc = json.load(f)

    def check(body, name):
        jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
                                        ).validate(body)

    check(await health(jp_fetch), "Health")
    code, body = await spawn(jp_fetch, CAP + 1)
    assert code == 503
    check(body, "Error")
    assert "503" in doc["paths"]["/v1/sandboxes"]["post"]["responses"]
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a renamed figure is refused
        check({"ok": True, "capacity": {**(await health(jp_fetch))["capacity"], "mem_free": 1}}, "Health")


async def test_healthz_answers_while_every_control_thread_is_held(jp_fetch, forkd_app):
    """A health check never queues behind control calls: with all of them held (blocked on an
    event only this test sets), /healthz still answers with its capacity block."""
    admission = forkd_app.admission
    release = threading.Event()
    workers = admission.control_pool._max_workers
    held = [asyncio.ensure_future(admission.control(lambda: release.wait(60))) for _ in range(workers)]
    try:
        deadline = time.monotonic() + 30
        while admission.control_running < workers:  # bounded polling: every control thread taken
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        body = await asyncio.wait_for(health(jp_fetch), 30)
        assert set(body["capacity"]) == BLOCK
        assert not any(f.done() for f in held)  # they were held all along
    finally:
        release.set()
        await asyncio.gather(*held)


async def test_no_cap_is_null(jp_fetch, forkd_app, monkeypatch):
    monkeypatch.setattr(forkd_app.controller, "max_sandboxes", None)
    assert (await health(jp_fetch))["capacity"]["max_sandboxes"] is None


async def test_a_spawn_past_the_cap_is_refused_whole(jp_fetch, snap):
    code, kids = await spawn(jp_fetch, 2)
    assert code == 201 and len(kids) == 2
    code, body = await spawn(jp_fetch, 2)  # 2 + 2 > 3: none of the two starts
    assert_full(code, body, 2, 2)
    assert sorted(await listed(jp_fetch)) == sorted(k["id"] for k in kids)
    code, more = await spawn(jp_fetch, 1)  # what fits still does
    assert code == 201 and len(more) == 1
    code, body = await spawn(jp_fetch, 1)
    assert_full(code, body, 1, 3)
    assert (await health(jp_fetch))["capacity"]["sandboxes"] == 3
    assert (await call(jp_fetch, "DELETE", "sandboxes", kids[0]["id"]))[0] == 204  # a kill makes room
    code, _ = await spawn(jp_fetch, 1)
    assert code == 201


async def test_two_spawns_at_once_cannot_both_take_the_room(jp_fetch, snap):
    answers = await asyncio.gather(spawn(jp_fetch, 2), spawn(jp_fetch, 2))
    codes = sorted(code for code, _ in answers)
    assert codes == [201, 503], answers
    assert len(await listed(jp_fetch)) == 2


async def test_a_workspace_past_the_cap_is_refused(jp_fetch, forkd_app, snap):
    assert (await spawn(jp_fetch, CAP))[0] == 201
    code, body = await call(jp_fetch, "POST", "workspaces", body={"name": "w", "snapshot_tag": "cap"})
    assert_full(code, body, 1, CAP)
    assert (await call(jp_fetch, "GET", "workspaces")) == (200, [])


async def test_a_sandbox_that_died_unseen_does_not_hold_room(jp_fetch, forkd_app, snap):
    code, kids = await spawn(jp_fetch, CAP)
    assert code == 201
    ctl = forkd_app.controller
    row = ctl.registry.get_sandbox(kids[0]["id"])
    engine = ctl.engines[row["engine"]]
    os.kill(row["handle"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.alive(row["handle"]):  # bounded polling of the real condition: its process is gone
        assert time.monotonic() < deadline, "the killed sandbox's process did not end within 30 s"
        await asyncio.sleep(0.05)
    assert (await health(jp_fetch))["capacity"]["sandboxes"] == CAP  # not looked at yet: still counted
    code, more = await spawn(jp_fetch, 1)  # meeting the cap, the spawn looks, and the dead one goes
    assert code == 201, more
    assert kids[0]["id"] not in await listed(jp_fetch)


def test_memory_free_is_bounded_by_the_data_dirs_cgroup(forkd_data_dir, monkeypatch):
    """A memory limit on the engine's group for this data dir shows in memory_free (the host's
    MemAvailable is far larger)."""
    from forkd_engine.cgroups import Cgroups, memory_room, subtree
    from forkd_server.controller.capacity import mem_available, memory_free

    where = locate("memory")
    if where is None:
        pytest.skip("no memory cgroup controller on this host")
    version, base = where
    group = subtree("forkd-captest", forkd_data_dir)
    path = os.path.join(base, group)
    limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    if version == "v2":  # v2 gives a controller to a group's children only where each ancestor enables it
        for parent in (base, os.path.dirname(path)):
            os.makedirs(parent, exist_ok=True)
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
    os.makedirs(path, exist_ok=True)
    try:
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(200 << 20))
        assert memory_room(group) == 200 << 20  # nothing runs in it: all of the limit is left

        class Engine:  # what memory_free asks of an engine: its Cgroups
            cgroups = Cgroups(group)
        assert memory_free({"e": Engine()}) == 200 << 20 < mem_available()
        # MemAvailable moves from one read to the next on a busy host: the same figure for both sides
        from forkd_server.controller import capacity
        monkeypatch.setattr(capacity, "mem_available", lambda: 123 << 30)
        assert memory_free({}) == 123 << 30
        assert memory_free({"e": Engine()}) == 200 << 20
    finally:
        os.rmdir(path)
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # another test's group is still in it


def test_serve_flag():
    argv = build_argv(no_token=True, max_sandboxes=40)[0]
    assert "--ForkdApp.max_sandboxes=40" in argv
    assert "--ForkdApp.max_sandboxes=0" in build_argv(no_token=True, max_sandboxes=0)[0]  # 0: drain the host
    assert not any("max_sandboxes" in a for a in build_argv(no_token=True)[0])
    with pytest.raises(ServeError, match="--max-sandboxes must be 0 or more"):
        build_argv(no_token=True, max_sandboxes=-1)
