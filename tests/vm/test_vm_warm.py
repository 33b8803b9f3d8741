"""QEMUs started ahead (forkd_engine.vm.warm): a spawn after a spawn of the same snapshot takes them,
its children are as correct as cold ones, and none outlives its snapshot, its files or the engine."""

from __future__ import annotations

import ast
import os
import shutil
import tempfile

from forkd_engine import ChildSpec, SnapshotSpec
from forkd_engine import linux

from .conftest import ev, requires_qemu

pytestmark = requires_qemu

LOOK = ("(marker, counter, blob_sha, __import__('socket').gethostname(), open('/etc/machine-id').read(), "
        "random.random())")


def ready_pids(engine) -> list[int]:
    with engine.warm.lock:
        return [w.handle["pid"] for w in engine.warm.ready]


def gone(pid: int) -> bool:
    return linux.process_start_time(pid) is None


def test_a_second_spawn_takes_prestarted_qemus_whose_children_are_their_own(vm_engine, parent, kids):
    kids += vm_engine.spawn(parent, [ChildSpec(id="warm-first")])
    kids += vm_engine.spawn(parent, [ChildSpec(id="warm-second")])  # from its second spawn on
    assert vm_engine.warm.wait_filled(parent, 120)
    ready = set(ready_pids(vm_engine))
    assert len(ready) == vm_engine.warm.size >= 1
    # nothing of the user's runs in the parent's guest (its settle said so): the pooled guests ran
    # ahead until their agents answered, and were paused again
    assert parent.get("quiet") is True
    with vm_engine.warm.lock:
        assert all(w.prerun for w in vm_engine.warm.ready)
    vm_engine.restore_trace = []
    try:
        got = vm_engine.spawn(parent, [ChildSpec(id=f"warm-{i}") for i in range(vm_engine.warm.size + 1)])
        trace = {m["pid"]: m for m in vm_engine.restore_trace}
    finally:
        vm_engine.restore_trace = None
    kids += got
    taken = [h for h in got if h["pid"] in ready]
    assert len(taken) == len(ready) and all(trace[h["pid"]].get("warm") for h in taken)
    assert not any(trace[h["pid"]].get("warm") for h in got if h not in taken)  # the rest: cold
    for h in taken:  # named, found and answered like any child
        assert h["dir"] == vm_engine.qemu.vm_dir(h["name"]) and os.path.exists(h["socket"])
    seen = [ast.literal_eval(ev(vm_engine, h, LOOK)) for h in kids]
    assert {s[:3] for s in seen} == {("parent-state", 1, seen[0][2])}  # the snapshot's state
    for i in (3, 4, 5):  # hostname, machine id, random stream: each child's own
        assert len({s[i] for s in seen}) == len(kids)
    assert {s[3] for s in seen} == {h["name"] for h in kids}


def test_prestarted_qemus_end_with_their_engine_snapshot_or_files(vm_engine):
    from forkd_engine.vm import VMEngine
    root = tempfile.mkdtemp(prefix="fkvw")
    make = lambda: VMEngine(os.path.join(root, "vm"), cache_dir=vm_engine.cache_dir, warm=1)  # noqa: E731
    engine = make()
    try:
        snap = engine.create_snapshot(SnapshotSpec(tag="w", setup="x = 1"))
        engine.kill(engine.spawn(snap, [ChildSpec(id="a")])[0])
        assert engine.warm.wait_filled(snap, 120) and ready_pids(engine) == []  # spawned once: none
        engine.kill(engine.spawn(snap, [ChildSpec(id="a2")])[0])
        assert engine.warm.wait_filled(snap, 120)
        (pid,) = ready_pids(engine)
        engine.close()  # a server's end
        assert gone(pid)
        engine = make()  # the next server, on the same files
        for name in ("b", "b2"):
            engine.kill(engine.spawn(snap, [ChildSpec(id=name)])[0])
        assert engine.warm.wait_filled(snap, 120)
        (pid,) = ready_pids(engine)
        # the snapshot's RAM file is another file now (written back from a store, say): not served
        os.utime(snap["memory"], ns=(1, 1))
        engine.restore_trace = []
        engine.kill(engine.spawn(snap, [ChildSpec(id="c")])[0])
        assert not engine.restore_trace[0].get("warm") and gone(pid)
        assert engine.warm.wait_filled(snap, 120)
        (pid,) = ready_pids(engine)
        engine.delete_snapshot(snap)
        assert gone(pid) and ready_pids(engine) == []
        assert os.listdir(engine.run_dir) == []  # no directory of a pre-started QEMU left
    finally:
        engine.close()
        shutil.rmtree(engine.mem_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def test_a_snapshot_whose_guest_runs_user_work_is_pooled_but_never_run_ahead(vm_engine, kids):
    """A process the setup left running would run before a child's restore line if the pooled guest
    ran ahead: such a snapshot is not quiet, its QEMUs wait unrun, and its children are as before."""
    snap = vm_engine.create_snapshot(SnapshotSpec(
        tag="busy", setup="import random, subprocess\nsleeper = subprocess.Popen(['sleep', '3600'])\n",
        mem_size_mib=256))
    try:
        assert not snap.get("quiet")
        kids += vm_engine.spawn(snap, [ChildSpec(id="busy-1")])
        kids += vm_engine.spawn(snap, [ChildSpec(id="busy-2")])
        assert vm_engine.warm.wait_filled(snap, 120)
        with vm_engine.warm.lock:
            pooled = [w for w in vm_engine.warm.ready if w.key[0] == "busy"]
        assert pooled and not any(w.prerun for w in pooled)
        vm_engine.restore_trace = []
        try:
            got = vm_engine.spawn(snap, [ChildSpec(id="busy-3")])
            assert vm_engine.restore_trace[0].get("warm")
        finally:
            vm_engine.restore_trace = None
        kids += got
        looks = [ast.literal_eval(ev(vm_engine, h, "(sleeper.poll(), random.random(), __import__('socket').gethostname())"))
                 for h in kids if h["name"].startswith("busy-")]
        assert [x[0] for x in looks] == [None, None, None]  # the process runs on in each
        assert len({x[1] for x in looks}) == 3 and {x[2] for x in looks} == {"busy-1", "busy-2", "busy-3"}
    finally:
        for h in [k for k in kids if k["name"].startswith("busy-")]:
            vm_engine.kill(h)
            kids.remove(h)
        vm_engine.delete_snapshot(snap)
