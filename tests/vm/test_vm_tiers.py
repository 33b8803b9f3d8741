"""An idle notebook on the VM engine holds no RAM: the forkd kernel freezes its sandbox after
``$FORKD_KERNEL_FREEZE_AFTER`` seconds, stores it after ``$FORKD_KERNEL_STORE_AFTER`` (its QEMU
ends, its RAM file leaves tmpfs), a server killed and started again keeps it stored, and the next
cell wakes it from the store under the same id with ``x`` intact (and a seeded generator's stream
unbroken: a wake is no copy), saying how long the wake took and its split (idle times of seconds
here, so the test waits little)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from forkd_engine.store import chunks
from jupyter_client.manager import start_new_kernel

from forkd_server.client import Controller

from ..conftest import cleanup
from ..kernel.cells import head_of, run
from ..kernel.conftest import ServerForKernels
from .conftest import requires_qemu

pytestmark = [requires_qemu, pytest.mark.slow]


@pytest.fixture(scope="module")
def idle_vm_kernel(vm_root):
    cache = os.environ.get("FORKD_VM_CACHE") or os.path.join(vm_root, "cache")  # the image built once
    server = ServerForKernels()
    try:
        km, kc = start_new_kernel(kernel_name="forkd-python", startup_timeout=600,
                                  env={**os.environ, "FORKD_VM_CACHE": cache, "FORKD_KERNEL_ENGINE": "vm",
                                       "FORKD_KERNEL_FREEZE_AFTER": "1", "FORKD_KERNEL_STORE_AFTER": "3"})
        try:
            yield server, kc
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)
    finally:
        server.stop()


def test_a_vm_notebook_goes_frozen_then_stored_and_the_next_cell_wakes_it(idle_vm_kernel):
    server, kc = idle_vm_kernel
    ctl = Controller(server.url, server.token)
    events = ctl.events(timeout=300)  # open before the first cell: every move of HEAD is seen
    # makes the base snapshot first; a seeded generator, whose stream a wake must not change
    assert run(kc, "x = 21\nimport random\nrandom.seed(7)\nfirst = random.random()", timeout=900).ok
    head = head_of(kc)
    pid = ctl.get_sandbox(head)["pid"]
    moves = []
    try:
        for event in events:  # frozen may last only seconds: the events say it, not a poll's luck
            if event.get("action") == "tier" and event.get("id") == head:
                moves.append(event["tier"])
                if event["tier"] == "stored":
                    break
    finally:
        events.close()
    assert moves == ["frozen", "stored"]
    info = ctl.get_sandbox(head)
    assert info["pid"] is None and not os.path.exists(f"/proc/{pid}")  # no QEMU: no process, no RAM
    assert ctl.memory(head)["rss_kib"] == 0
    assert "stored" in run(kc, "%forkd head").result
    server.server.crash_and_restart()  # kill -9 of the server: the sandbox stays stored, and wakeable
    assert ctl.get_sandbox(head)["tier"] == "stored"
    cell = run(kc, "x * 2, random.random() == [r.random() for r in [random.Random(7)] for _ in '12'][1]",
               timeout=300)
    assert cell.result == "(42, True)", cell.text  # the same id, its state intact, its stream unbroken
    woke = [c["text"] for c in cell.of("stream") if "woke" in c["text"]]
    assert len(woke) == 1 and f"woke this notebook's sandbox {head} from stored in " in woke[0]
    assert "fetch" in woke[0] and "decompress" in woke[0] and "restore" in woke[0]
    assert head_of(kc) == head and ctl.get_sandbox(head)["tier"] == "running"


def test_by_hand_a_stored_sandbox_wakes_from_the_remote_store_when_this_host_lost_its_chunks(vm_engine, tmp_path,
                                                                                          monkeypatch):
    """freeze -> store -> wake through the routes' code, with a remote store: the store pushes it, and
    a wake after the local store lost its chunks (evicted, say) fetches them back, verified, in one
    pass (each decompressed once, straight into the RAM file); then its copy leaves the remote store."""
    from forkd_server.controller import Controller as ServerController

    data = tempfile.mkdtemp(prefix="fkvt")
    ctl = ServerController(data, engines={"vm": vm_engine}, store=f"file://{tmp_path}/remote")
    try:
        ctl.create_snapshot("tiny", engine="vm", mem_size_mib=192, setup="x = 20")
        sb = ctl.spawn("tiny")[0]["id"]
        ctl.run_code(sb, "x += 1")
        assert ctl.freeze_sandbox(sb)["tier"] == "frozen"
        info = ctl.store_sandbox(sb)
        assert info["tier"] == "stored" and info["pid"] is None
        stored = ctl.registry.get_sandbox(sb)["stored"]
        assert stored["remote"] is True and not os.path.exists(stored["handle"]["memory"])  # no RAM file
        pushed = f"{tmp_path}/remote/manifests/{stored['digest'].split(':')[1]}"
        assert os.path.exists(pushed)
        store = vm_engine.store
        others = set().union(*(store.get_manifest(d).chunks() for name, d in store.pins().items()
                               if name != stored["handle"]["tag"] and store.get_manifest(d)))
        lost = set(store.get_manifest(stored["digest"]).chunks()) - others
        for chunk in lost:  # only what no other snapshot here uses: the session's engine is shared
            os.unlink(store.chunk_path(chunk))
        ram = store.get_manifest(stored["digest"]).files["memory.bin"]["chunks"]
        needed = len({c for c in ram if isinstance(c, str)}) + 2 * sum(isinstance(c, dict) for c in ram)
        assert ctl.stores.wait_idle(120)  # no other store work decompresses meanwhile
        decompressed = []
        real = chunks.decompress
        monkeypatch.setattr(chunks, "decompress", lambda blob, size: decompressed.append(1) or real(blob, size))
        woke = ctl.wake_sandbox(sb)["wake"]
        monkeypatch.undo()
        assert woke["from"] == "stored" and woke["fetched_bytes"] > 0
        # one pass: every object of the RAM file (a page patch: it and its base) decompressed once
        assert len(decompressed) == needed
        assert woke["fetch_ms"] > 0 and woke["decompress_ms"] > 0 and woke["restore_ms"] > 0
        assert ctl.eval(sb, "x")["result"] == "21" and ctl.get_sandbox(sb)["tier"] == "running"
        # woken, it is no longer stored: its copy leaves the remote store too (stored_copies.py)
        assert ctl.stores.stored_copies.wait_idle(60)
        assert not os.path.exists(pushed)
    finally:
        end(ctl, data)


def test_closing_stops_a_store_under_way_and_the_next_start_stores_the_snapshot(vm_engine):
    """A snapshot that becomes ready goes into the local store in the background. Closing meanwhile
    stops that at its next chunk and waits for the worker, so nothing writes into the data dir once
    ``close`` returned (a test that deleted its data dir right after found it written again); the
    next start stores the snapshot."""
    from forkd_server.controller import Controller as ServerController

    data = tempfile.mkdtemp(prefix="fkvc")
    ctl = ServerController(data, engines={"vm": vm_engine})
    again = None
    try:
        ctl.create_snapshot("closing", engine="vm", mem_size_mib=192, setup="x = 20")
        ctl.stores.close()  # its store was queued as it became ready
        assert not ctl.stores._worker.is_alive() and not ctl.stores.stored_copies._worker.is_alive()
        ctl.registry.close()
        again = ServerController(data, engines={"vm": vm_engine})
        assert again.stores.wait_idle(120)
        info = again.get_snapshot("closing")
        assert info["status"] == "ready" and info["stored"]["remote"] is False, info
        sb = again.spawn("closing")[0]["id"]
        assert again.eval(sb, "x")["result"] == "20"
    finally:
        end(again or ctl, data)


def end(ctl, data: str) -> None:
    """Delete what an in-process controller on the session's VM engine made, and its data dir; the
    engine, shared, stays open."""
    cleanup(ctl)
    ctl.stores.close()
    ctl.registry.close()
    shutil.rmtree(data, ignore_errors=True)
