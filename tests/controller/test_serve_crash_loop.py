"""kill -9 of ``forkd serve`` in the middle of a burst of spawns, branches and kills, round after
round: after each restart every snapshot listed ready really spawns, every listed sandbox answers
a ping, nothing is left writing, and no call hangs (every call is bounded by the client's timeout)."""

from __future__ import annotations

import os
import secrets
import threading

import pytest

from forkd_server.client import Controller, ControllerError, ServerUnreachable

from ..conftest import requires_root, wait_gone
from ..serving import cleanup, serving

pytestmark = [requires_root, pytest.mark.slow]

ROUNDS = 10
WORKERS = 3
CALL_TIMEOUT = 30  # seconds: a call that takes longer is stuck


def worker(url: str, token: str, stop: threading.Event, started: threading.Semaphore, seen_pids: set) -> None:
    """Spawn, branch (live without waiting, or full), spawn from the branch, kill: until stopped.
    Errors are expected once the server is killed under us."""
    client = Controller(url, token, timeout=CALL_TIMEOUT)
    n = 0
    while not stop.is_set():
        n += 1
        try:
            kids = client.spawn_sandboxes("base", 2)
            seen_pids.update(k["pid"] for k in kids)
            started.release()
            tag = f"b-{threading.get_ident() % 10000}-{n}-{secrets.token_hex(2)}"
            client.branch_sandbox(kids[0]["id"], tag, mode="live" if n % 2 else "full", wait=n % 2 == 0)
            started.release()
            client.kill_sandbox(kids[1]["id"])
            more = client.spawn_sandboxes(tag, 1) if n % 2 == 0 else []
            seen_pids.update(k["pid"] for k in more)
        except (ControllerError, ServerUnreachable):
            if stop.is_set():
                return


def check_after_restart(client: Controller) -> None:
    snapshots = client.list_snapshots()
    assert not [s["tag"] for s in snapshots if s["status"] == "writing"], snapshots
    for snap in snapshots:
        if snap["status"] == "ready":
            (kid,) = client.spawn_sandboxes(snap["tag"], 1)   # a ready snapshot really spawns
            assert client.ping_sandbox(kid["id"])["pong"] is True
            client.kill_sandbox(kid["id"])
        else:
            assert snap["warning"], snap                       # failed says why
    for sb in client.list_sandboxes():
        assert sb["status"] == "running"
        assert client.ping_sandbox(sb["id"])["pong"] is True  # a listed sandbox answers


def test_kill_9_of_serve_mid_burst_then_restart_loop():
    with serving() as server:
        url, token = server.url, server.token
        client = Controller(url, token, timeout=CALL_TIMEOUT)
        seen_pids: set[int] = set()
        client.create_snapshot("base", setup="value = 41", engine="process")
        for round_no in range(ROUNDS):
            stop, started = threading.Event(), threading.Semaphore(0)
            threads = [threading.Thread(target=worker, args=(url, token, stop, started, seen_pids), daemon=True)
                       for _ in range(WORKERS)]
            for t in threads:
                t.start()
            for _ in range(2 * WORKERS + 2 * (round_no % 4)):  # under way, a little further each round
                assert started.acquire(timeout=CALL_TIMEOUT), "the burst did not get going"
            stop.set()
            server.crash_and_restart()                 # kill -9 with calls in flight, start again
            for t in threads:
                t.join(CALL_TIMEOUT + 5)
                assert not t.is_alive(), "a call outlived the client's timeout: stuck"
            check_after_restart(client)
            assert client.eval_code(client.spawn_sandboxes("base", 1)[0]["id"], "value")["result"] == "41"
        cleanup(url, token)
        assert client.list_sandboxes() == []
        assert wait_gone(seen_pids) == set()                    # every sandbox ever made is gone
        assert os.listdir(os.path.join(server.data_dir, "process", "run")) == []   # and every template's socket
