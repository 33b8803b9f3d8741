"""A VM branch carries everything (the rows the VM engine claims in README's "What a fork carries"):
running threads and processes, exit statuses the user's code waits for, fresh tempfile names."""

from __future__ import annotations

from forkd_engine import SnapshotSpec

from .conftest import ev, requires_qemu, run
from .test_vm_engine import spawn

pytestmark = requires_qemu


def test_exit_statuses_belong_to_the_users_code(vm_engine, parent, kids):
    (sb,) = spawn(vm_engine, parent, kids)
    got = run(vm_engine, sb, "import subprocess, time\ncodes = []\n"
                             "for _ in range(10):\n"
                             "    p = subprocess.Popen(['sh', '-c', 'exit 3'])\n"
                             "    time.sleep(0.02)\n"
                             "    codes.append(p.wait())\n"
                             "fails = 0\n"
                             "for _ in range(10):\n"
                             "    try:\n"
                             "        subprocess.check_output(['false'])\n"
                             "    except subprocess.CalledProcessError:\n"
                             "        fails += 1\n"
                             "set(codes), fails", timeout=120)
    assert got == "({3}, 10)"


def test_threads_and_processes_are_carried_into_a_branch(vm_engine, parent, kids):
    (src,) = spawn(vm_engine, parent, kids)
    run(vm_engine, src, "import subprocess, threading, time\nticks = []\n"
                        "def tick():\n    while True:\n        ticks.append(1)\n        time.sleep(0.02)\n"
                        "threading.Thread(target=tick, name='ticker', daemon=True).start()\n"
                        "server = subprocess.Popen(['sleep', '600'])")
    assert vm_engine.inventory(src) == []  # nothing is lost: no lossy flag needed
    res = vm_engine.branch(src, "carried", ["parent", "src", "carried"], "full")
    snap = res.ready.result(120)
    try:
        assert res.warnings == []
        (g,) = spawn(vm_engine, snap, kids, prefix="g")
        assert ev(vm_engine, g, "[t.name for t in threading.enumerate() if t.name == 'ticker']") == "['ticker']"
        assert run(vm_engine, g, "n = len(ticks)\ntime.sleep(0.3)\nlen(ticks) > n") == "True"
        assert ev(vm_engine, g, "server.poll()") == "None"  # the process runs in the copy too
    finally:
        vm_engine.delete_snapshot(snap)


def test_tempfile_names_differ_between_children(vm_engine, kids):
    snap = vm_engine.create_snapshot(SnapshotSpec(tag="tempnames", setup="import tempfile\nfirst = tempfile.mkdtemp()",
                                                  mem_size_mib=256))
    try:
        made = spawn(vm_engine, snap, kids, n=3)
        names = {ev(vm_engine, k, "[tempfile.mkdtemp() for _ in range(3)]") for k in made}
        assert len(names) == 3
    finally:
        vm_engine.delete_snapshot(snap)
