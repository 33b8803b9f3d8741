"""kill -9 of ``forkd serve`` in the middle of a VM burst (live branches without waiting, full
branches, spawns of 1-5 children, kills and deletes from 4 threads), round after round: every
start-up succeeds (whatever the VMs were doing), the server settles everything it recorded, a
listed sandbox answers, and after cleanup no QEMU of the server's data dir is left running."""

from __future__ import annotations

import os
import random
import threading

import pytest

from forkd_server.client import Controller

from ..conftest import requires_root, wait_gone
from ..serving import burst, cleanup, serving
from .conftest import requires_qemu

pytestmark = [requires_root, requires_qemu, pytest.mark.slow]

ROUNDS = 5
WORKERS = 4
CALL_TIMEOUT = 120  # seconds: a VM call under TCG on a loaded host is slow, not stuck


def qemus_of(data_dir: str) -> set[int]:
    """QEMUs running in the data dir's VM directories (their directory may be gone)."""
    run = os.path.join(data_dir, "vm", "run") + os.sep
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/cwd").startswith(run):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


# Each round's burst leaves dozens of QEMUs restoring under TCG on 2 cores: a test beside it that
# waits on a browser or a kernel for a bounded time would be starved, not wrong.
@pytest.mark.exclusive
def test_kill_9_of_serve_mid_vm_burst_then_restart_loop():
    with serving() as server:
        url, token = server.url, server.token
        client = Controller(url, token, timeout=CALL_TIMEOUT)
        client.create_snapshot("base", engine="vm", setup="value = 41", mem_size_mib=192)
        rng = random.Random(20)
        for _ in range(ROUNDS):
            stop, progress = threading.Event(), threading.Semaphore(0)
            threads = [threading.Thread(target=burst, args=(url, token, stop, progress), daemon=True,
                                        kwargs={"prefix": "vb", "timeout": CALL_TIMEOUT})
                       for _ in range(WORKERS)]
            for t in threads:
                t.start()
            for _ in range(rng.randint(WORKERS, 3 * WORKERS)):  # under way: spawns and branches in flight
                assert progress.acquire(timeout=CALL_TIMEOUT), "the burst did not get going"
            stop.set()
            server.crash_and_restart()            # kill -9 mid-burst; the start-up must succeed, and settle
            for t in threads:
                t.join(CALL_TIMEOUT + 5)
                assert not t.is_alive(), "a call outlived the client's timeout: stuck"
            snapshots = client.list_snapshots()
            assert not [s["tag"] for s in snapshots if s["status"] == "writing"], snapshots
            assert all(s["warning"] for s in snapshots if s["status"] == "failed"), snapshots
            for sb in client.list_sandboxes():
                assert client.ping_sandbox(sb["id"])["pong"] is True
            (kid,) = client.spawn_sandboxes("base", 1)
            assert client.eval_code(kid["id"], "value")["result"] == "41"
            for sb in client.list_sandboxes():  # what a crash re-attached, so rounds do not pile it up
                client.kill_sandbox(sb["id"])
            for snap in client.list_snapshots():
                if snap["tag"] != "base":
                    client.delete_snapshot(snap["tag"])
        cleanup(url, token)
        assert client.list_sandboxes() == []
        assert client.list_snapshots() == []
        assert wait_gone(qemus_of(server.data_dir)) == set()  # no QEMU of the data dir runs
        for leftovers in ("run", "snapshots"):                 # and no VM or snapshot directory is left
            assert os.listdir(os.path.join(server.data_dir, "vm", leftovers)) == [], leftovers
