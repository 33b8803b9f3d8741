"""Pings answered on the server's event loop (loop_calls.py): the control pool's answers and errors;
whatever would make the loop wait for another thread goes to the pool, and the loop goes on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading

import pytest

from forkd_server.controller.registry import Registry

from ..signals import stopped
from .test_api import call, sandbox, snap  # noqa: F401 - the fixtures


def ways(app, call: str = "ping") -> dict[str, float]:
    """How many pings (evals) were answered on the loop and how many on a pool (the counter alone:
    the app's other metrics read the registry, which a test here holds)."""
    return {s.labels["way"]: s.value for metric in app.loop_calls.ways.collect() for s in metric.samples
            if s.name == "forkd_loop_calls_total" and s.labels["call"] == call}


async def ping(jp_fetch, sid: str):
    return await call(jp_fetch, "POST", "sandboxes", sid, "ping")


async def until(condition, what: str, timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def held_elsewhere(lock):
    """``lock`` held by another thread (a commit, a liveness check, a move) while the block runs."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(30)
    try:
        yield
    finally:
        release.set()
        holder.join(30)


async def test_a_running_sandboxs_ping_is_answered_on_the_loop(jp_fetch, forkd_app, sandbox):  # noqa: F811
    sid = sandbox["id"]
    before = ways(forkd_app)
    code, first = await ping(jp_fetch, sid)  # its first: the loop makes its lock (a spawn's first ping)
    assert code == 200 and first["pong"] is True and first["sandbox_id"] == sid
    assert ways(forkd_app)["loop"] == before["loop"] + 1 and ways(forkd_app)["pool"] == before["pool"]
    assert sid in forkd_app.controller.tiers._locks
    before = ways(forkd_app)
    for _ in range(3):
        code, body = await ping(jp_fetch, sid)
        assert code == 200 and body.keys() == first.keys() and (body["sandbox_id"], body["pid"]) == (sid, first["pid"])
    after = ways(forkd_app)
    # on the loop (one whose registry or liveness check another thread held that instant would
    # have gone to the pool, which is right too; nothing else runs in this server)
    assert after["loop"] - before["loop"] >= 1 and after["loop"] + after["pool"] - before["loop"] - before["pool"] == 3
    assert not forkd_app.controller.tiers._calls  # each call counted, and each done
    assert await ping(jp_fetch, "sb-nope") == (404, {"error": "sandbox sb-nope not found"})
    assert "sb-nope" not in forkd_app.controller.tiers._locks  # an unknown id makes no lock


@pytest.mark.parametrize("held", ["registry", "liveness", "sandbox"])
async def test_what_would_wait_goes_to_the_pool_and_the_loop_goes_on(jp_fetch, forkd_app, sandbox, held):  # noqa: F811
    """Another thread holds the registry (a commit waiting for the disk), the liveness check, or
    the sandbox's lock (a move): the ping waits for it on a control thread, not on the loop."""
    sid = sandbox["id"]
    ctl = forkd_app.controller
    assert (await ping(jp_fetch, sid))[0] == 200
    lock = {"registry": lambda: ctl.registry._lock, "liveness": lambda: ctl.engines["process"]._pidfd_lock,
            "sandbox": lambda: ctl.tiers._locks[sid]}[held]()
    with held_elsewhere(lock):
        before = ways(forkd_app)
        pinged = asyncio.ensure_future(ping(jp_fetch, sid))
        await until(lambda: ways(forkd_app)["pool"] > before["pool"], "the ping handed to the pool")
        code, version = await call(jp_fetch, "GET", "version", prefix=("forkd",))  # the loop answers meanwhile
        assert code == 200 and version["api"] == "v1" and not pinged.done()
    code, body = await pinged
    assert code == 200 and body["pong"] is True
    assert ways(forkd_app)["loop"] == before["loop"]


async def test_a_frozen_sandboxs_ping_wakes_it_on_the_pool(jp_fetch, forkd_app, sandbox):  # noqa: F811
    """... and the loop's connection kept to its agent, made before the freeze, serves it again."""
    sid = sandbox["id"]
    ctl = forkd_app.controller
    for _ in range(2):
        assert (await ping(jp_fetch, sid))[0] == 200
    assert ctl.freeze_sandbox(sid)["tier"] == "frozen"
    before = ways(forkd_app)
    code, body = await ping(jp_fetch, sid)
    assert code == 200 and body["pong"] is True
    assert ctl.get_sandbox(sid)["tier"] == "running"
    assert ways(forkd_app)["pool"] == before["pool"] + 1
    code, body = await ping(jp_fetch, sid)
    assert code == 200 and body["sandbox_id"] == sid
    assert kept(forkd_app) == 1  # (on the loop, unless another thread held the registry that instant)


async def test_a_change_another_process_commits_reaches_the_loops_next_ping(jp_fetch, forkd_app, sandbox):  # noqa: F811
    """The loop reads a sandbox's row from the registry's shared rows (``Registry.shared_sandbox``,
    kept from one ping to the next): a change another process commits to the data dir (a kill
    under way there) is seen by the very next ping, which the pool then answers."""
    sid = sandbox["id"]
    ctl = forkd_app.controller
    for _ in range(2):
        assert (await ping(jp_fetch, sid))[0] == 200
    before = ways(forkd_app)
    assert (await ping(jp_fetch, sid))[0] == 200  # the shared row serves it
    assert ways(forkd_app)["loop"] == before["loop"] + 1
    other = Registry(os.path.join(ctl.data_dir, "registry.sqlite3"))
    try:
        other.update_sandbox(sid, ending={"reason": "killed"})
        code, body = await ping(jp_fetch, sid)
        assert (code, body) == (404, {"error": f"sandbox {sid} not found"})
    finally:
        other.update_sandbox(sid, ending=None)  # the end was not real: the sandbox is killed as usual
        other.close()
    assert (await ping(jp_fetch, sid))[0] == 200
    assert not ctl.tiers._calls


async def test_an_agent_that_dies_during_a_ping_on_the_loop_is_a_410(jp_fetch, forkd_app, sandbox, monkeypatch):  # noqa: F811
    sid = sandbox["id"]
    assert (await ping(jp_fetch, sid))[0] == 200
    engine = forkd_app.controller.engines["process"]
    call_async = engine.call_async

    async def dying(handle, request, timeout=None, long=False):  # the agent is killed as the ping leaves
        os.kill(handle["pid"], signal.SIGKILL)
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_exit, handle, 30)
        return await call_async(handle, request, timeout=timeout, long=long)

    monkeypatch.setattr(engine, "call_async", dying)
    code, body = await ping(jp_fetch, sid)
    assert code == 410 and body["error"].startswith(f"sandbox {sid} ended during this ping: "), body
    assert (await ping(jp_fetch, sid))[0] == 404
    assert not forkd_app.controller.tiers._calls


async def test_a_silent_agent_is_the_pools_timeout(jp_fetch, forkd_app, sandbox):  # noqa: F811
    """A stopped agent (alive, answering nothing): 500 after the ping's 5 s, as on the pool, and the
    call no longer counted (the sandbox can be frozen)."""
    sid = sandbox["id"]
    assert (await ping(jp_fetch, sid))[0] == 200
    pid = sandbox["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        await until(lambda: stopped(pid), "every thread of the agent stopped")  # a stop takes each in turn
        before = ways(forkd_app)
        code, body = await ping(jp_fetch, sid)
        assert code == 500 and body["error"].startswith("ping: agent at ") and "did not answer within 5 s" in \
            body["error"], body
        assert ways(forkd_app)["pool"] == before["pool"]  # it was the loop's, explained on the pool
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not forkd_app.controller.tiers._calls
    assert (await ping(jp_fetch, sid))[0] == 200


def kept(app) -> int:
    """Connections the server keeps to agents for the loop's calls (agent/kept.py)."""
    return app.controller.engines["process"].kept.open_count()


async def test_a_sandboxs_loop_pings_share_one_connection_that_ends_with_its_agent(jp_fetch, forkd_app, sandbox):  # noqa: F811
    """A sandbox's pings on the loop go over one connection kept to its agent; the sandbox's end
    closes it (it never waits there for whatever comes next), and the sandbox spawned after it
    answers for itself on a connection of its own."""
    sid = sandbox["id"]
    for _ in range(3):
        code, body = await ping(jp_fetch, sid)
        assert code == 200 and body["sandbox_id"] == sid
    assert kept(forkd_app) == 1
    assert (await call(jp_fetch, "DELETE", "sandboxes", sid))[0] == 204
    await until(lambda: kept(forkd_app) == 0, "the killed sandbox's connection closed")
    assert (await ping(jp_fetch, sid))[0] == 404
    new = forkd_app.controller.spawn("py", 1)[0]["id"]
    for _ in range(3):
        code, body = await ping(jp_fetch, new)
        assert code == 200 and body["sandbox_id"] == new
    assert kept(forkd_app) == 1


async def test_a_branch_takes_no_copy_of_the_kept_connection(jp_fetch, forkd_app, sandbox):  # noqa: F811
    """A branch forks the sandbox's agent, connections and all: its copy of the server's kept
    connection is closed, so the source's end still closes the connection (a copy held open would
    leave it waiting for an answer nobody gives), and the branch's own sandboxes answer for
    themselves."""
    sid = sandbox["id"]
    for _ in range(2):
        assert (await ping(jp_fetch, sid))[0] == 200
    code, branch = await call(jp_fetch, "POST", "sandboxes", sid, "branch", body={"tag": "kept-b"})
    assert code == 201 and not branch.get("warnings"), branch  # the agent's own connection: nothing lost
    code, body = await ping(jp_fetch, sid)
    assert code == 200 and body["sandbox_id"] == sid
    child = forkd_app.controller.spawn("kept-b", 1)[0]["id"]
    for _ in range(2):
        code, body = await ping(jp_fetch, child)
        assert code == 200 and body["sandbox_id"] == child
    assert kept(forkd_app) == 2
    assert (await call(jp_fetch, "DELETE", "sandboxes", sid))[0] == 204
    await until(lambda: kept(forkd_app) == 1, "the source's connection closed")
    code, body = await ping(jp_fetch, child)
    assert code == 200 and body["sandbox_id"] == child


# --- evals: admitted as before, then made on the loop on a connection of their own --------------

async def evaluate(jp_fetch, sid: str, code: str):
    return await call(jp_fetch, "POST", "sandboxes", sid, "eval", body={"code": code})


async def test_an_eval_is_made_on_the_loop_and_a_long_one_holds_up_no_ping(jp_fetch, forkd_app, sandbox):  # noqa: F811
    """A running sandbox's eval, once admitted, is made on the loop with the pool's answers (a
    value, an error, a 404); a long eval goes on a connection of its own, so the sandbox's pings
    answer meanwhile, and the sandbox's lane still admits one eval at a time."""
    sid = sandbox["id"]
    assert (await ping(jp_fetch, sid))[0] == 200  # a sandbox's first call makes its lock, on the pool
    before = ways(forkd_app, "eval")
    assert await evaluate(jp_fetch, sid, "x + 1") == (200, {"result": "42", "error": None, "exit_code": 0})
    code, body = await evaluate(jp_fetch, sid, "1 / 0")
    assert code == 200 and body["exit_code"] == 1 and body["error"].startswith("ZeroDivisionError"), body
    after = ways(forkd_app, "eval")
    # (one whose registry or liveness check another thread held that instant went to the pool)
    assert after["loop"] - before["loop"] >= 1 and after["loop"] + after["pool"] - before["loop"] - before["pool"] == 2
    assert await evaluate(jp_fetch, "sb-nope", "1") == (404, {"error": "sandbox sb-nope not found"})

    slow = asyncio.ensure_future(evaluate(jp_fetch, sid, "__import__('time').sleep(3) or 'slept'"))
    await until(lambda: forkd_app.admission.running == 1, "the slow eval running")
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(3):
        code, body = await ping(jp_fetch, sid)
        assert code == 200 and body["sandbox_id"] == sid
    assert loop.time() - started < 2.5 and not slow.done()  # answered while the eval runs
    second = asyncio.ensure_future(evaluate(jp_fetch, sid, "'second'"))
    await until(lambda: forkd_app.admission.lanes[sid].waiting, "the second eval waiting for the lane")
    assert await slow == (200, {"result": "'slept'", "error": None, "exit_code": 0})
    assert await second == (200, {"result": "'second'", "error": None, "exit_code": 0})
    assert kept(forkd_app) == 2  # the pings' connection and the evals'
    assert not forkd_app.controller.tiers._calls and forkd_app.admission.running == 0


async def test_an_eval_that_would_wait_runs_on_the_pool(jp_fetch, forkd_app, sandbox):  # noqa: F811
    """Another thread holds the sandbox's lock (a move): the eval runs on a long call's thread,
    which waits for it, and the loop goes on."""
    sid = sandbox["id"]
    assert (await ping(jp_fetch, sid))[0] == 200
    with held_elsewhere(forkd_app.controller.tiers._locks[sid]):
        before = ways(forkd_app, "eval")
        evaluated = asyncio.ensure_future(evaluate(jp_fetch, sid, "x"))
        await until(lambda: ways(forkd_app, "eval")["pool"] > before["pool"], "the eval handed to the pool")
        code, version = await call(jp_fetch, "GET", "version", prefix=("forkd",))  # the loop answers meanwhile
        assert code == 200 and version["api"] == "v1" and not evaluated.done()
    assert await evaluated == (200, {"result": "41", "error": None, "exit_code": 0})
    assert ways(forkd_app, "eval")["loop"] == before["loop"]


async def test_a_sandbox_killed_during_an_eval_on_the_loop_is_a_410(jp_fetch, forkd_app, sandbox):  # noqa: F811
    sid = sandbox["id"]
    for _ in range(2):  # the first on the pool (it makes the sandbox's lock), the second on the loop
        assert (await ping(jp_fetch, sid))[0] == 200
    before = ways(forkd_app, "eval")
    slow = asyncio.ensure_future(evaluate(jp_fetch, sid, "__import__('time').sleep(60)"))
    await until(lambda: forkd_app.admission.running == 1, "the eval running")
    assert kept(forkd_app) == 2  # the eval's own connection
    assert (await call(jp_fetch, "DELETE", "sandboxes", sid))[0] == 204
    code, body = await slow
    assert code == 410 and f"sandbox {sid} was killed during this call (an eval)" in body["error"], body
    assert ways(forkd_app, "eval") == before  # failed on the loop (one handed to the pool counts there)
    await until(lambda: kept(forkd_app) == 0, "the killed sandbox's connections closed")
    assert not forkd_app.controller.tiers._calls and forkd_app.admission.running == 0


async def test_an_exec_is_made_on_the_loop_with_the_pools_answers(jp_fetch, forkd_app, sandbox):  # noqa: F811
    sid = sandbox["id"]
    ctl = forkd_app.controller
    assert (await ping(jp_fetch, sid))[0] == 200
    before = ways(forkd_app, "exec")
    for body in ({"args": ["sh", "-c", "echo out; echo err >&2; exit 3"]},
                 {"args": ["sh", "-c", "pwd; echo $FOO"], "env": {"FOO": "bar"}, "cwd": "/tmp"},
                 {"args": ["sleep", "5"], "timeout_secs": 0.5}):
        code, answer = await call(jp_fetch, "POST", "sandboxes", sid, "exec", body=body)
        on_a_thread = await asyncio.get_running_loop().run_in_executor(  # the pool's way, as it was
            None, lambda: ctl.exec(sid, body["args"], body.get("timeout_secs", 30), env=body.get("env"),
                                   cwd=body.get("cwd")))
        assert code == 200 and answer == on_a_thread, (answer, on_a_thread)
    assert answer["timed_out"] is True and "timed out after 0.5 seconds" in answer["error"], answer
    after = ways(forkd_app, "exec")
    assert after["loop"] - before["loop"] >= 1 and after["loop"] + after["pool"] - before["loop"] - before["pool"] == 3
    code, body = await call(jp_fetch, "POST", "sandboxes", sid, "exec", body={"args": []})
    assert code == 400 and body == {"error": "args must be a non-empty list of strings"}, body
    assert not ctl.tiers._calls and forkd_app.admission.running == 0
