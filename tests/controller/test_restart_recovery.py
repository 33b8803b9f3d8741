"""A restart that listens first and settles in the background; a kill cut short by a crash.

- 100 sandboxes whose agents do not answer (stopped) when ``forkd serve`` starts again: the port
  answers while they are still being settled (``/healthz`` says how many are left, a call about
  one answers 503 "recovering", which the SDK asks again until settled), a sandbox that answers is
  back before them, and each silent one is then ended and dropped, saying why.
- A kill the server was in the middle of when it died (its end recorded, its process killed or
  not yet): the next start-up finishes it, so no process is left that no record names.
- An object whose settling raises fails alone (a sandbox ended, a snapshot failed, saying why).
- A silent agent no record names (a spawn cut short) is killed by the socket it holds.
- The settling starts only once the server listens (``Controller.listening``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from forkd_server.client import Controller as Client
from forkd_server.client import ControllerError
from forkd_server.controller import Controller
from forkd_server.errors import NotFound

from ..conftest import engine_processes, requires_root, wait_gone
from ..rest import exchange
from ..serving import serving
from .conftest import cleanup, ev

pytestmark = requires_root

STALE = 100
PROBE_TIMEOUT = 20  # s: the silent agents stay "recovering" this long, a window no start-up needs


def until(check, timeout: float = 60):
    """Bounded polling of ``check`` until it returns something true; returns that."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)
    return got


def answer(server, path: str) -> tuple[int, dict]:
    """(status, body) of one GET, as is (the SDK would ask again while it says recovering)."""
    return exchange(server.url + path, headers={"Authorization": f"Bearer {server.token}"}, timeout=30)


@pytest.mark.slow
def test_restart_with_100_stale_agents_listens_before_they_are_settled():
    with serving(f"--ForkdApp.recovery_probe_timeout={PROBE_TIMEOUT}") as server:
        client = Client(server.url, server.token, timeout=PROBE_TIMEOUT + 60)
        client.create_snapshot("stale", setup="x = 1", engine="process")
        stale = client.spawn_sandboxes("stale", STALE)
        (fine,) = client.spawn_sandboxes("stale", 1)
        server.crash()
        for sb in stale:
            os.kill(sb["pid"], signal.SIGSTOP)  # alive, and silent: each ping waits its whole timeout
        try:
            server.start()
            server.wait_healthy()
            # Listening before settled: the port answers while the stale agents are still recovering.
            assert server.health()["recovering"] >= STALE
            status, body = answer(server, f"/v1/sandboxes/{stale[0]['id']}")
            assert status == 503 and "is recovering" in body["error"] and body["recovering"] is True, body
            assert stale[0]["id"] not in {s["id"] for s in answer(server, "/v1/sandboxes")[1]}
            # The tree keeps the lineage whole, saying which nodes are not settled yet.
            statuses = {n["id"]: n["status"] for n in answer(server, "/v1/tree")[1]}
            assert statuses[stale[0]["id"]] == "recovering", statuses
            # One that answers is back at once, while the silent ones still wait for their pings.
            until(lambda: answer(server, f"/v1/sandboxes/{fine['id']}")[0] == 200)
            assert client.ping_sandbox(fine["id"])["pong"] is True
            assert "recovering" in server.health() and answer(server, f"/v1/sandboxes/{stale[-1]['id']}")[0] == 503
            # The SDK asks again while it says recovering: this call returns once the sandbox is settled.
            with pytest.raises(ControllerError) as ended:
                client.get_sandbox(stale[0]["id"])
            assert ended.value.status == 404 and "did not answer when the server started" in ended.value.message
            server.wait_settled(PROBE_TIMEOUT + 60)
            assert [s["id"] for s in client.list_sandboxes()] == [fine["id"]]
            assert wait_gone({sb["pid"] for sb in stale}) == set()  # ended, all of them
            assert "recovery settled in" in server.output()
        finally:
            for sb in stale:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(sb["pid"], signal.SIGCONT)


SERVER = textwrap.dedent("""
    import json, sys, time
    from forkd_engine.process.engine import ProcessEngine
    from forkd_server.controller import Controller
    c = Controller(sys.argv[1])
    c.create_snapshot("race", setup="v = 1")
    kids = c.spawn("race", 2)
    real = ProcessEngine.kill
    def cut_short(self, handle):
        if sys.argv[2] == "after-sigkill":
            real(self, handle)            # the process is gone; its record not yet
        print(json.dumps({"ids": [k["id"] for k in kids], "pids": [k["pid"] for k in kids]}), flush=True)
        time.sleep(3600)                  # the server is killed here, mid-kill
    ProcessEngine.kill = cut_short
    c.kill_sandbox(kids[0]["id"])
""")


@pytest.mark.parametrize("when", ["before-sigkill", "after-sigkill"])
def test_a_kill_cut_short_by_a_crash_is_finished_at_start_up(short_dir, when):
    before = engine_processes(short_dir)
    proc = subprocess.Popen([sys.executable, "-c", SERVER, short_dir, when], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the server exited before its kill"
        got = json.loads(line)
    finally:
        proc.kill()
        proc.wait()
    (victim, other), (victim_pid, _other_pid) = got["ids"], got["pids"]
    if when == "before-sigkill":
        assert os.path.exists(f"/proc/{victim_pid}")  # the DELETE was in flight: it lives on for now
    c = Controller(short_dir)
    try:
        assert wait_gone({victim_pid}) == set()
        with pytest.raises(NotFound, match="killed"):
            c.get_sandbox(victim)
        assert any(f"sandbox {victim}: finished its end" in f for f in c.recovered["findings"]), c.recovered
        assert [s["id"] for s in c.list_sandboxes()] == [other]
        assert ev(c, other, "v") == "1"
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()



def test_an_object_that_cannot_be_recovered_fails_alone(short_dir, monkeypatch):
    """Whatever one object's settling raises (here: its engine's repair), the start-up goes on: that
    sandbox is ended and dropped saying why, that snapshot failed saying why and its template ended
    (its init holds the pid namespace of the sandboxes spawned from it: they run on), the rest
    re-attached."""
    from forkd_engine.process.engine import ProcessEngine

    before = engine_processes(short_dir)
    c = Controller(short_dir)
    try:
        c.create_snapshot("good", setup="v = 1")
        c.create_snapshot("bad", setup="v = 2")
        broken, fine = c.spawn("good", 2)
        (child_of_bad,) = c.spawn("bad", 1)
        bad_template = c.registry.get_snapshot("bad")["handle"]["pid"]
        doomed = {broken["pid"], bad_template}
    finally:
        c.close()

    def repair(self, handle):
        if handle["pid"] in doomed:
            raise OSError("an engine fault no one foresaw")
        return []

    monkeypatch.setattr(ProcessEngine, "repair", repair)
    c = Controller(short_dir)
    try:
        assert wait_gone({broken["pid"]}) == set()
        with pytest.raises(NotFound, match="could not be recovered when the server started .*no one foresaw"):
            c.get_sandbox(broken["id"])
        bad = c.get_snapshot("bad")
        assert bad["status"] == "failed" and "no one foresaw" in bad["warning"], bad
        assert "its template was ended" in bad["warning"], bad
        assert wait_gone({bad_template}) == set()  # nothing of a failed snapshot runs on
        assert {s["id"] for s in c.list_sandboxes()} == {fine["id"], child_of_bad["id"]}
        assert ev(c, fine["id"], "v") == "1"
        assert ev(c, child_of_bad["id"], "v") == "2"  # a sandbox outlives its template's end
        assert c.get_snapshot("good")["status"] == "ready"
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


def test_a_silent_agent_no_record_names_is_killed_by_the_socket_it_holds(short_dir, monkeypatch):
    """A spawn the server died before recording (a ``starting`` row, no handle) whose agent does
    not answer "retire": it is found by the listening socket it holds and killed, its init with it."""
    from forkd_engine.process import engine as process_engine

    before = engine_processes(short_dir)
    c = Controller(short_dir)
    try:
        c.create_snapshot("s", setup="v = 1")
        (sb,) = c.spawn("s", 1)
        c.registry.update_sandbox(sb["id"], status="starting", handle=None)  # as a crash mid-spawn leaves it
    finally:
        c.close()
    os.kill(sb["pid"], signal.SIGSTOP)
    monkeypatch.setattr(process_engine, "ABANDON_TIMEOUT", 1.0)
    c = Controller(short_dir)
    try:
        assert wait_gone({sb["pid"]}) == set()
        assert any(f"sandbox {sb['id']}: ended its start" in f for f in c.recovered["findings"]), c.recovered
        with pytest.raises(NotFound):
            c.get_sandbox(sb["id"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sb["pid"], signal.SIGCONT)
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


def test_the_settling_starts_once_the_server_listens(short_dir, monkeypatch):
    """A background recovery reads the registry at once (the object is pending: calls about it answer
    503) but starts no thread until ``listening()``: the server's start up to its port is its own.
    Then the object is settled and taken back."""
    before = engine_processes(short_dir)
    c = Controller(short_dir)
    try:
        c.create_snapshot("s", setup="v = 1")
        (sb,) = c.spawn("s", 1)
    finally:
        c.close()
    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread):
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    c = Controller(short_dir, recover_in_background=True)
    try:
        assert c.recovery.unsettled() == {"s", sb["id"]}
        assert not [name for name in started if name.startswith(("forkd-recovery", "forkd-settle", "forkd-vm"))]
        c.listening()
        until(lambda: c.recovery.pending == 0)
        assert [s["id"] for s in c.list_sandboxes()] == [sb["id"]]
        assert ev(c, sb["id"], "v") == "1"
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


def test_a_snapshot_made_before_the_signal_guard_says_so_after_a_restart(short_dir):
    """A process-engine snapshot whose handle does not say its tree is guarded (made by an older
    forkd) is attached as it is, and carries a warning that says what it lacks and what to do."""
    from forkd_engine.process.engine import UNGUARDED

    c = Controller(short_dir)
    try:
        c.create_snapshot("now", setup="v = 1")
        c.create_snapshot("old", setup="v = 2")
        row = c.registry.get_snapshot("old")
        c.registry.update_snapshot("old", handle={k: v for k, v in row["handle"].items() if k != "signal_guard"})
    finally:
        c.close()
    c = Controller(short_dir)
    try:
        assert c.get_snapshot("old")["warnings"] == [UNGUARDED]
        assert "warnings" not in c.get_snapshot("now")
        assert ev(c, c.spawn("old", 1)[0]["id"], "v") == "2"  # a warning, not a refusal
    finally:
        cleanup(c)
        c.close()
