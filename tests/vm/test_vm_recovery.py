"""A live branch whose writer dies: in the server (its thread fails) or with it (kill -9 of the
server mid-stream). QEMU 7.2 then leaves the source's RAM write-protected and a vCPU waiting on it
while holding the lock every QMP command needs: the VM is frozen while its process lives. The
engine lifts the protect (or kills the source, saying why); a restarted server finds such VMs and
RAM files no snapshot owns, repairs or removes them and says so."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from forkd_engine import ChildSpec, EngineError
from forkd_engine.vm import memory as vmem
from forkd_engine.vm import snapshots

from ..conftest import cleanup
from .conftest import ev, requires_qemu, run

pytestmark = requires_qemu

# A guest thread rewriting 64 MiB page by page: during a live branch its writes fault on
# write-protected pages all the time, so a lost writer freezes it at once.
SCRIBBLE = ("import threading\nscribble = bytearray(64 << 20)\ndef _scribble():\n    i = 0\n    while True:\n"
            "        scribble[(i * 4096) % len(scribble)] = i & 255\n        i += 1\n"
            "threading.Thread(target=_scribble, daemon=True).start()")


def vcpus_waiting_on_a_fault(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if not f.read().startswith("CPU "):
                continue
        with open(f"/proc/{pid}/task/{tid}/wchan") as f:
            if f.read() == "handle_userfault":
                return True
    return False


def test_writer_failing_in_the_server_leaves_the_source_running(vm_engine, parent, kids, monkeypatch):
    (src,) = vm_engine.spawn(parent, [ChildSpec(id=f"lw-{time.monotonic_ns()}")])
    kids.append(src)
    run(vm_engine, src, SCRIBBLE + "\nkept = 'mine'")
    real = vmem.split_stream
    seen = {}

    def writer_dies(stream, mem_path, mem_size):
        stream.read(1 << 20)  # some of RAM, then the write fails (a full disk, a bug...)
        deadline = time.monotonic() + 30
        while not vcpus_waiting_on_a_fault(src["pid"]) and time.monotonic() < deadline:
            time.sleep(0.01)  # bounded: until the guest waits on a protected page
        seen["frozen"] = vcpus_waiting_on_a_fault(src["pid"])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vmem, "split_stream", writer_dies)
    result = vm_engine.branch(src, "lost-writer", ["parent", src["name"], "lost-writer"], "live")
    with pytest.raises(EngineError) as failure:
        result.ready.result(120)
    assert seen["frozen"], "the guest never waited on a write-protected page: the test proved nothing"
    assert ev(vm_engine, src, "kept", timeout=10) == "'mine'"         # thawed: it answers and runs
    assert "No space left" in str(failure.value) and f"the source {src['name']} runs on" in str(failure.value)
    assert not vcpus_waiting_on_a_fault(src["pid"])
    assert not os.path.exists(os.path.join(vm_engine.mem_root, "lost-writer"))
    monkeypatch.setattr(vmem, "split_stream", real)
    full = vm_engine.branch(src, "after-lost-writer", ["parent", src["name"], "after-lost-writer"], "full")
    snap = full.ready.result(120)                                        # the source branches again
    vm_engine.delete_snapshot(snap)


SERVER = textwrap.dedent("""
    import json, os, sys, time
    from forkd_engine.vm import VMEngine
    from forkd_engine.vm import memory as vmem
    from forkd_server.controller import Controller
    data, cache = sys.argv[1], sys.argv[2]
    c = Controller(data, engines={"vm": VMEngine(os.path.join(data, "vm"), cache_dir=cache)})
    def say(**kw):
        print(json.dumps(kw), flush=True)
    c.create_snapshot("base", engine="vm", setup="value = 7", mem_size_mib=256)
    sb = c.spawn("base", 1)[0]["id"]
    c.run_code(sb, sys.argv[3])
    def stalled(stream, mem_path, mem_size):
        stream.read(1 << 20)
        say(step="streaming", id=sb)
        time.sleep(3600)                 # killed here, mid-stream
    vmem.split_stream = stalled
    c.branch(sb, "mid-stream", mode="live", wait=False)
    time.sleep(3600)
""")


def test_server_killed_mid_live_branch_then_restart_thaws_the_source(vm_engine):
    from forkd_engine.vm import VMEngine
    from forkd_server.controller import Controller

    data = tempfile.mkdtemp(prefix="fkvr")  # short: socket paths are limited to 107 bytes
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    server = subprocess.Popen([sys.executable, "-c", SERVER, data, vm_engine.cache_dir, SCRIBBLE],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        assert line, "the server exited before streaming"
        sid = json.loads(line)["id"]
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    mem_root = VMEngine(os.path.join(data, "vm"), cache_dir=vm_engine.cache_dir).mem_root
    orphan = os.path.join(mem_root, "orphan-ram")                  # RAM nobody owns: removed too
    os.makedirs(orphan)
    with open(os.path.join(orphan, "memory.bin"), "wb") as f:
        f.truncate(8 << 20)
    engine = VMEngine(os.path.join(data, "vm"), cache_dir=vm_engine.cache_dir)  # the restarted server's
    pid = None
    c = Controller(data, engines={"vm": engine})
    try:
        pid = c.registry.get_sandbox(sid)["handle"]["pid"]
        found = "\n".join(c.recovered["findings"])
        assert "lifted the write-protect" in found, found
        assert "orphan-ram" in found and not os.path.exists(orphan)
        assert c.get_snapshot("mid-stream")["status"] == "failed"
        assert not os.path.exists(os.path.join(engine.mem_root, "mid-stream"))
        assert [s["id"] for s in c.list_sandboxes()] == [sid]
        assert c.eval(sid, "value")["result"] == "7"
        assert not vcpus_waiting_on_a_fault(pid)
        info = c.branch(sid, "after-restart", mode="full")
        assert info["status"] == "ready"
    finally:
        cleanup(c)
        c.close()
        if pid is not None and os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(engine.mem_root, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)


def test_delete_of_a_vm_snapshot_being_created_cancels_it(vm_engine):
    import threading

    from forkd_server.controller import Controller
    from forkd_server.errors import Conflict, NotFound

    data = tempfile.mkdtemp(prefix="fkvc")
    c = Controller(data, engines={"vm": vm_engine})
    outcome = {}

    def create():
        try:
            c.create_snapshot("vm-doomed", engine="vm", setup="import time\ntime.sleep(600)", mem_size_mib=256)
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    creator = threading.Thread(target=create)
    try:
        creator.start()
        deadline = time.monotonic() + 120
        while vm_engine.creating.get("vm-doomed", {}).get("handle") is None:
            assert time.monotonic() < deadline and creator.is_alive(), outcome
            time.sleep(0.05)                               # bounded: until its VM runs
        pid = vm_engine.creating["vm-doomed"]["handle"]["pid"]
        c.delete_snapshot("vm-doomed")
        creator.join(60)
        assert isinstance(outcome.get("error"), Conflict), outcome
        with pytest.raises(NotFound):
            c.get_snapshot("vm-doomed")
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
        assert not os.path.exists(os.path.join(vm_engine.snap_dir, "vm-doomed"))
        assert not os.path.exists(os.path.join(vm_engine.mem_root, "vm-doomed"))
    finally:
        c.registry.close()
        shutil.rmtree(data, ignore_errors=True)


def test_mem_size_mib_that_cannot_fit_is_a_400_at_once(vm_engine, monkeypatch):
    from forkd_server.controller import Controller
    from forkd_server.errors import BadRequest

    data = tempfile.mkdtemp(prefix="fkvc")
    c = Controller(data, engines={"vm": vm_engine})

    def no_boot(engine, spec, *args):
        raise AssertionError(f"the engine began to build {spec.tag}: the size was not refused at once")

    monkeypatch.setattr(snapshots, "_create", no_boot)
    try:
        with pytest.raises(BadRequest, match="mem_size_mib must be between 192 and"):
            c.create_snapshot("huge", engine="vm", mem_size_mib=1 << 20)      # 1 TiB: past the host's RAM
        # within the host's RAM but not within the tmpfs that holds RAM files (here: made small)
        monkeypatch.setattr(snapshots, "mem_root_free_mib", lambda mem_root: 200)
        with pytest.raises(BadRequest, match="mem_size_mib 256 does not fit.*200 MiB free"):
            c.create_snapshot("huge", engine="vm", mem_size_mib=256)
        assert c.list_snapshots() == []
    finally:
        c.registry.close()
        shutil.rmtree(data, ignore_errors=True)
