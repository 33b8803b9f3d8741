"""The VM engine under TCG: state through generations, isolation, fork hygiene, branch modes."""

from __future__ import annotations

import ast
import os
import re
import threading
import time

import pytest

from forkd_engine import ChildSpec, EngineError, UnsupportedMode
from forkd_engine.vm import memory as vmem

from .conftest import ev, requires_qemu, run

pytestmark = requires_qemu


def spawn(engine, snapshot, kids, n=1, prefix="c"):
    made = engine.spawn(snapshot, [ChildSpec(id=f"{prefix}{i}-{time.monotonic_ns()}") for i in range(n)])
    kids.extend(made)
    return made


def test_image_is_cached_and_keyed_by_inputs(vm_engine, parent):
    from forkd_engine.vm.image import build_image
    first = vm_engine.image()
    again = build_image(vm_engine.cache_dir)
    assert again.key == first.key and again.initrd == first.initrd
    assert os.path.getsize(first.kernel) > 10 << 20 and open(first.kernel, "rb").read(4) == b"\x7fELF"


def test_snapshot_files_and_meta(vm_engine, parent):
    assert vm_engine.alive(parent)
    assert os.path.getsize(parent["memory"]) == 256 << 20
    assert open(parent["devices"], "rb").read(4) == b"QEVM"
    assert parent["accel"] == vm_engine.accel
    with pytest.raises(EngineError, match="does not|not a VM|no running agent"):
        vm_engine.call(parent, {"action": "ping"})


def test_state_parent_child_grandchild(vm_engine, parent, kids):
    (child,) = spawn(vm_engine, parent, kids)
    assert ev(vm_engine, child, "(marker, counter)") == "('parent-state', 1)"
    run(vm_engine, child, "counter += 1\nchild_note = 'from-child'")
    res = vm_engine.branch(child, "gen2", ["parent", "c", "gen2"], "full")
    snap2 = res.ready.result(120)
    (grand,) = spawn(vm_engine, snap2, kids, prefix="g")
    assert ev(vm_engine, grand, "(marker, counter, child_note)") == "('parent-state', 2, 'from-child')"
    assert ev(vm_engine, grand, "hashlib.sha256(blob).hexdigest() == blob_sha") == "True"
    run(vm_engine, grand, "counter += 1")
    snap3 = vm_engine.branch(grand, "gen3", ["parent", "c", "gen2", "g", "gen3"], "diff").ready.result(120)
    (great,) = spawn(vm_engine, snap3, kids, prefix="gg")
    assert ev(vm_engine, great, "(counter, child_note)") == "(3, 'from-child')"
    # the sources kept running, unchanged by what their descendants did
    run(vm_engine, great, "counter = 100")
    assert ev(vm_engine, grand, "counter") == "3"
    assert ev(vm_engine, child, "counter") == "2"
    for s in (snap2, snap3):
        vm_engine.delete_snapshot(s)


def test_siblings_are_isolated_memory_and_files(vm_engine, parent, kids):
    a, b = spawn(vm_engine, parent, kids, n=2)
    run(vm_engine, a, "counter = 42\nopen('/root/note.txt', 'w').write('only a')\nopen('/tmp/t', 'w').write('a')")
    assert ev(vm_engine, a, "counter") == "42"
    assert ev(vm_engine, b, "counter") == "1"
    assert ev(vm_engine, b, "os.path.exists('/root/note.txt') or os.path.exists('/tmp/t')") == "False"
    reply = vm_engine.call(a, {"action": "files", "op": "read", "path": "/root/note.txt"})
    assert reply["size"] == 6
    # a new sibling spawned later sees the snapshot, not a's changes
    (c,) = spawn(vm_engine, parent, kids)
    assert ev(vm_engine, c, "(counter, os.path.exists('/root/note.txt'))") == "(1, False)"


def test_fork_hygiene_entropy_clock_identity(vm_engine, parent, kids):
    a, b = spawn(vm_engine, parent, kids, n=2)
    code = ("(os.urandom(16).hex(), random.random(), open('/proc/sys/kernel/random/uuid').read().strip(),"
            " __import__('uuid').uuid4().hex, time.time())")
    ra = ast.literal_eval(ev(vm_engine, a, code))
    rb = ast.literal_eval(ev(vm_engine, b, code))
    for x, y in zip(ra[:4], rb[:4]):
        assert x != y
    # the Python stream seeded before the snapshot is reseeded too
    assert ev(vm_engine, a, "random.random() != first_random") == "True"
    # the wall clock was stepped to the host's (the snapshot may be minutes old)
    assert abs(ra[4] - time.time()) < 2 and abs(rb[4] - time.time()) < 2
    pa = vm_engine.call(a, {"action": "ping"})
    assert pa["sandbox_id"] == a["name"] and pa["role"] == "sandbox"
    hosts = {ev(vm_engine, h, "__import__('socket').gethostname()") for h in (a, b)}
    assert len(hosts) == 2
    machine_ids = {ast.literal_eval(ev(vm_engine, h, "open('/etc/machine-id').read()")) for h in (a, b)}
    assert len(machine_ids) == 2 and all(re.fullmatch(r"[0-9a-f]{32}\n", m) for m in machine_ids)


def test_exec_and_memory_sharing(vm_engine, parent, kids):
    a, b, c = spawn(vm_engine, parent, kids, n=3)
    reply = vm_engine.call(a, {"action": "exec", "args": ["sh", "-c", "echo hi; uname -r"]})
    assert reply["exit_code"] == 0 and reply["stdout"].startswith("hi\n")
    m = vm_engine.memory(b)
    assert m["pss_kib"] < m["rss_kib"]


def release(engine, handle) -> None:
    """Let a cell started with BUSY_UNTIL_RELEASED end (it loops until /tmp/release exists)."""
    reply = engine.call(handle, {"action": "exec", "args": ["touch", "/tmp/release"]}, timeout=30)
    assert reply["exit_code"] == 0, reply


# A busy cell that runs until the test releases it, so it cannot end before the test has done what
# it needs however slow the machine is; the deadline only keeps a failed test from leaving it running.
BUSY_UNTIL_RELEASED = ("open('/tmp/busy', 'w').close()\nt_end = time.time() + 300\n"
                       "while not os.path.exists('/tmp/release') and time.time() < t_end:\n"
                       "    ticks += 1\n    work[ticks % len(work)] = 7\n"
                       "open('/tmp/ended', 'w').close()")


@pytest.mark.parametrize("mode", ["full", "diff", "live"])
def test_branch_busy_vm_every_mode(vm_engine, parent, kids, mode):
    (src,) = spawn(vm_engine, parent, kids)
    run(vm_engine, src, "work = bytearray(os.urandom(16 << 20))\nticks = 0")
    # keep the guest busy (a loop holding the agent's eval lock) while it is branched
    busy = threading.Thread(target=vm_engine.call, args=(src, {"action": "run_code", "code": BUSY_UNTIL_RELEASED}),
                            kwargs={"timeout": 120}, daemon=True)
    busy.start()
    try:
        # wait (inside the guest, bounded) until the loop is running
        started = vm_engine.call(src, {"action": "exec", "timeout": 20,
                                       "args": ["sh", "-c", "while [ ! -e /tmp/busy ]; do :; done"]}, timeout=30)
        assert started["exit_code"] == 0, started
        tag = f"busy-{mode}"
        res = vm_engine.branch(src, tag, ["parent", "src", tag], mode)
        assert res.pause_ms > 0
        snap = res.ready.result(120)
    finally:
        release(vm_engine, src)
        busy.join(60)
    assert not busy.is_alive()
    g1, g2 = spawn(vm_engine, snap, kids, n=2, prefix="g")
    # the grandchild resumes mid-loop: the loop goes on there until released, and ticks kept counting
    for g in (g1, g2):
        still = vm_engine.call(g, {"action": "exec", "args": ["test", "-e", "/tmp/ended"]}, timeout=30)
        assert still["exit_code"] == 1, still
        release(vm_engine, g)
        assert ev(vm_engine, g, "len(work), os.path.exists('/tmp/ended')") == f"({16 << 20}, True)"
        assert int(ev(vm_engine, g, "ticks", timeout=60)) > 0
    # the source kept running through the branch and its state is its own
    run(vm_engine, g1, "ticks = -1")
    assert int(ev(vm_engine, src, "ticks")) > 0
    assert ev(vm_engine, g2, "ticks") != "-1"
    meta = snap["dir"]
    assert os.path.exists(os.path.join(meta, "branch.json"))
    vm_engine.delete_snapshot(snap)


def test_live_mode_impossible_names_why(vm_engine, parent, kids, monkeypatch):
    (src,) = spawn(vm_engine, parent, kids)
    monkeypatch.setattr(vmem, "filesystem_type", lambda path: "ext4")
    with pytest.raises(UnsupportedMode, match="tmpfs"):
        vm_engine.branch(src, "never", ["x"], "live")
    assert not os.path.exists(os.path.join(vm_engine.snap_dir, "never"))


def test_killed_source_mid_live_branch_fails_cleanly(vm_engine, parent, kids):
    (src,) = spawn(vm_engine, parent, kids)
    res = vm_engine.branch(src, "doomed", ["parent", "src", "doomed"], "live")
    os.kill(src["pid"], 9)
    with pytest.raises(EngineError):
        res.ready.result(60)
    assert not os.path.exists(os.path.join(vm_engine.snap_dir, "doomed"))
    assert not vm_engine.alive(src)


def test_reattach_from_a_new_engine_instance(vm_engine, parent, kids):
    """A restarted server builds a new engine: it finds the VM by pid + start time and reconnects."""
    from forkd_engine.vm import VMEngine
    (a,) = spawn(vm_engine, parent, kids)
    run(vm_engine, a, "counter = 5")
    vm_engine._drop_channel(a)  # the old server's connection goes away
    other = VMEngine(vm_engine.data_dir, cache_dir=vm_engine.cache_dir, mem_root=vm_engine.mem_root)
    try:
        assert other.alive(a) and other.alive(parent)
        assert ev(other, a, "counter") == "5"
        assert not other.alive(dict(a, start_time=a["start_time"] + 1))  # a reused pid is not ours
    finally:
        other.close()


def test_snapshot_from_another_qemu_is_refused(vm_engine, parent):
    with pytest.raises(EngineError, match="not portable"):
        vm_engine.spawn(dict(parent, qemu="QEMU emulator version 9.9.9"), [ChildSpec(id="never")])


def test_disk_overlays_isolate_siblings_and_carry_through_branches(vm_engine, kids):
    from forkd_engine import SnapshotSpec
    snap = vm_engine.create_snapshot(SnapshotSpec(
        tag="withdisk", mem_size_mib=256, disk_mib=64,
        setup="import os\nopen('/data/base.txt', 'w').write('base')\nos.sync()"))
    try:
        assert os.path.exists(snap["disk"])
        a, b = spawn(vm_engine, snap, kids, n=2)
        assert ev(vm_engine, a, "open('/data/base.txt').read()") == "'base'"
        run(vm_engine, a, "open('/data/a.txt', 'w').write('only a')\nos.sync()")
        assert ev(vm_engine, b, "os.listdir('/data')").count("a.txt") == 0
        # the disk layer follows the branch, in every mode; the source goes on writing its own
        for mode in ("full", "diff", "live"):
            s2 = vm_engine.branch(a, f"disk-{mode}", ["withdisk", "a", mode], mode).ready.result(120)
            run(vm_engine, a, f"open('/data/after-{mode}.txt', 'w').write('x')\nos.sync()")
            (g,) = spawn(vm_engine, s2, kids, prefix="gd")
            files = ast.literal_eval(ev(vm_engine, g, "sorted(os.listdir('/data'))"))
            assert "a.txt" in files and "base.txt" in files and f"after-{mode}.txt" not in files
            # after a drop of the guest's page cache the files still read back from the disk
            run(vm_engine, g, "os.sync()\nopen('/proc/sys/vm/drop_caches', 'w').write('3')")
            assert ev(vm_engine, g, "open('/data/a.txt').read()") == "'only a'"
            vm_engine.kill(g)
            kids.remove(g)
            vm_engine.delete_snapshot(s2)
    finally:
        vm_engine.delete_snapshot(snap)


def test_a_child_keeps_its_disk_when_its_snapshot_is_deleted(vm_engine, kids):
    from forkd_engine import SnapshotSpec
    snap = vm_engine.create_snapshot(SnapshotSpec(
        tag="gone-disk", mem_size_mib=256, disk_mib=32,
        setup="import os\nopen('/data/base.txt', 'w').write('base')\nos.sync()"))
    (a,) = spawn(vm_engine, snap, kids)
    vm_engine.delete_snapshot(snap)               # children outlive their snapshot, disk included
    run(vm_engine, a, "open('/data/a.txt', 'w').write('a')\nos.sync()\n"
                      "open('/proc/sys/vm/drop_caches', 'w').write('3')")
    assert ev(vm_engine, a, "open('/data/base.txt').read()") == "'base'"
    s2 = vm_engine.branch(a, "gone-disk-b", ["gone-disk", "a", "b"], "full").ready.result(120)
    try:
        (g,) = spawn(vm_engine, s2, kids, prefix="gg")
        assert ast.literal_eval(ev(vm_engine, g, "sorted(os.listdir('/data'))"))[:2] == ["a.txt", "base.txt"]
    finally:
        vm_engine.delete_snapshot(s2)


def test_settle_waits_for_exiting_threads_not_live_ones(vm_engine, parent, kids):
    (a,) = spawn(vm_engine, parent, kids)
    run(vm_engine, a, "import threading\nstop = threading.Event()\n"
                      "bg = threading.Thread(target=stop.wait, daemon=True)\nbg.start()")
    reply = vm_engine.call(a, {"action": "settle", "timeout": 10})
    # the request threads that just replied are gone; the live background thread is counted, not
    # awaited (awaited, it would still be there at the deadline: settled false)
    assert reply["settled"] is True and reply["tasks"] >= 2, reply
    run(vm_engine, a, "stop.set()\nbg.join()")
    assert vm_engine.call(a, {"action": "settle"})["settled"] is True


def test_snapshot_waits_for_an_idle_guest(vm_engine, parent, kids):
    (a,) = spawn(vm_engine, parent, kids)
    assert vm_engine.qemu.vcpu_ns(a["pid"]) > 0          # the vCPU threads are found by name
    run(vm_engine, a, "x = sum(range(10))")
    assert vm_engine.qemu.wait_idle(a) is True            # an idle guest's vCPU sleeps
    busy = threading.Thread(target=vm_engine.call, args=(a, {
        "action": "run_code",
        "code": "open('/tmp/spinning', 'w').close()\nt_end = time.time() + 300\n"
                "while not os.path.exists('/tmp/release') and time.time() < t_end: pass"}, 120), daemon=True)
    busy.start()
    try:
        deadline = time.monotonic() + 10
        while "spinning" not in {e["name"] for e in
                                 vm_engine.call(a, {"action": "files", "op": "list", "path": "/tmp"})["entries"]}:
            assert time.monotonic() < deadline, "the busy loop never started"
        assert vm_engine.qemu.wait_idle(a, limit=0.5) is False   # a spinning guest never goes quiet
    finally:
        release(vm_engine, a)
        busy.join(60)
    assert not busy.is_alive()


def test_a_failing_child_takes_down_the_whole_spawn_and_leaves_nothing(vm_engine, parent, tmp_path):
    bad = dict(parent, devices=str(tmp_path / "devices.bin"))
    with open(parent["devices"], "rb") as f:
        (tmp_path / "devices.bin").write_bytes(f.read()[:64])     # a torn device state
    ids = [f"bad{i}-{time.monotonic_ns()}" for i in range(4)]
    with pytest.raises(EngineError, match="did not come up"):
        vm_engine.spawn(bad, [ChildSpec(id=i) for i in ids])
    assert not any(os.path.exists(vm_engine.qemu.vm_dir(i)) for i in ids)
    cmdlines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdlines.append(f.read().decode(errors="replace"))
        except OSError:
            pass  # it exited meanwhile
    assert not any(vm_engine.qemu.vm_dir(i) in c for i in ids for c in cmdlines)  # no QEMU of theirs is left
