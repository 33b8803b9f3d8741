"""A VM branch carries everything: each test proves rows of the table in docs/design/fork-correctness.md
(files, file objects and shared mappings are the copy's own; running threads, processes, event loops,
pending tasks, sockets and imports in progress go on in the copy; exit statuses stay the user's;
tempfile names differ)."""

from __future__ import annotations

import pytest

from forkd_engine import SnapshotSpec

from .. import streams
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
    # a shell that exits at once leaves its background child to PID 1 (the agent): once it has
    # exited it must be reaped, not left a zombie (whose /proc entry would stay)
    orphan = vm_engine.call(sb, {"action": "exec", "args": ["sh", "-c", "sleep 0.2 & echo $!; exit 0"]})
    pid = int(orphan["stdout"])
    assert run(vm_engine, sb, f"deadline = time.time() + 30\n"
                              f"while os.path.exists('/proc/{pid}') and time.time() < deadline:\n"
                              f"    time.sleep(0.05)\n"
                              f"os.path.exists('/proc/{pid}')", timeout=60) == "False"


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
        # the thread ticks on in the copy (waited for, bounded: a loaded machine cannot fake a stop)
        assert run(vm_engine, g, "n, end = len(ticks), time.time() + 30\n"
                                 "while len(ticks) == n and time.time() < end:\n    time.sleep(0.01)\n"
                                 "len(ticks) > n") == "True"
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


def branch_and_spawn(engine, source, kids, tag: str, n: int = 2):
    """Branch ``source`` (nothing may be reported lost on this engine) and spawn ``n`` grandchildren."""
    assert engine.inventory(source) == []
    res = engine.branch(source, tag, ["parent", "src", tag], "full")
    snap = res.ready.result(120)
    assert res.warnings == []
    return snap, spawn(engine, snap, kids, n=n, prefix="g")


@pytest.mark.slow
def test_files_file_objects_and_shared_mappings_are_each_copys_own(vm_engine, parent, kids):
    """Rows: files in /tmp, /dev/shm and the cwd; open file objects and TemporaryFiles; MAP_SHARED."""
    (src,) = spawn(vm_engine, parent, kids)
    run(vm_engine, src, "import mmap, tempfile\n"
                        "open('/tmp/t.txt', 'w').write('from source')\n"
                        "open('/dev/shm/state', 'w').write('in shm')\n"
                        "os.makedirs('/root/work/sub', exist_ok=True); os.chdir('/root/work/sub')\n"
                        "open('notes.txt', 'w').write('from source')\n"
                        "log = open('/tmp/log.txt', 'a'); log.write('source\\n'); log.flush()\n"
                        "tf = tempfile.TemporaryFile(); tf.write(b'kept'); tf.flush()\n"
                        "f = open('/tmp/shared.bin', 'w+b'); f.write(bytes(4096)); f.flush()\n"
                        "m = mmap.mmap(f.fileno(), 4096); m[:5] = b'SRC00'\n"     # a file, MAP_SHARED
                        "anon = mmap.mmap(-1, 4096); anon[:3] = b'src'\n"         # anonymous, MAP_SHARED
                        "from multiprocessing import shared_memory\n"             # and its tracker process
                        "sm = shared_memory.SharedMemory(create=True, size=4096); sm.buf[:3] = b'src'")
    snap, (g1, g2) = branch_and_spawn(vm_engine, src, kids, "files-own")
    try:
        assert ev(vm_engine, g1, "os.getcwd()") == "'/root/work/sub'"
        assert ev(vm_engine, g1, "(open('/tmp/t.txt').read(), open('/dev/shm/state').read(), "
                                 "open('notes.txt').read())") == "('from source', 'in shm', 'from source')"
        assert ev(vm_engine, g1, "bytes(m[:5]), bytes(anon[:3])") == "(b'SRC00', b'src')"
        run(vm_engine, g1, "open('/tmp/t.txt', 'w').write('g1'); open('/dev/shm/state', 'w').write('g1')\n"
                           "open('notes.txt', 'w').write('g1'); open('/tmp/new.txt', 'w').write('g1')\n"
                           "log.write('g1\\n'); log.flush()\n"
                           "tf.seek(0); tf.write(b'CHANGED'); tf.flush()\n"
                           "m[:5] = b'GRAND'; m.flush(); anon[:3] = b'g1!'; sm.buf[:3] = b'g1!'")
        assert ev(vm_engine, g1, "open('/tmp/log.txt').read(), open('/tmp/shared.bin', 'rb').read(5)") \
            == repr(("source\ng1\n", b"GRAND"))
        # neither a sibling nor the source sees any of g1's writes
        for other in (g2, src):
            assert ev(vm_engine, other, "(open('/tmp/t.txt').read(), open('/dev/shm/state').read(), "
                                        "open('notes.txt').read(), os.path.exists('/tmp/new.txt'))") \
                == "('from source', 'in shm', 'from source', False)"
            assert ev(vm_engine, other, "open('/tmp/log.txt').read()") == repr("source\n")
            assert ev(vm_engine, other, "(tf.seek(0), tf.read())[1]") == "b'kept'"
            assert ev(vm_engine, other, "bytes(m[:5]), bytes(anon[:3]), open('/tmp/shared.bin', 'rb').read(5)") \
                == "(b'SRC00', b'src', b'SRC00')"
            assert ev(vm_engine, other, "bytes(sm.buf[:3]), open('/dev/shm/' + sm.name, 'rb').read(3)") \
                == "(b'src', b'src')"
    finally:
        vm_engine.delete_snapshot(snap)


@pytest.mark.slow
def test_event_loops_tasks_sockets_and_imports_in_progress_are_carried(vm_engine, parent, kids):
    """Rows: an idle asyncio loop, pending asyncio tasks, the user's sockets, a module another thread
    is importing: all go on in the copy, and the copy's use of them never reaches the source."""
    (src,) = spawn(vm_engine, parent, kids)
    run(vm_engine, src, "import asyncio, socket, sys, threading\n"
                        "loop = asyncio.new_event_loop(); asyncio.set_event_loop(loop)\n"
                        "async def twice(x):\n    await asyncio.sleep(0.01)\n    return 2 * x\n"
                        "loop.run_until_complete(twice(1))\n"
                        "fut = loop.create_future()\n"
                        "async def waiter():\n    return 10 * await fut\n"
                        "task = loop.create_task(waiter())\n"
                        "loop.run_until_complete(asyncio.sleep(0))\n"             # the task is now awaiting fut
                        "left, right = socket.socketpair()\n"
                        "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()\n"
                        "cli = socket.create_connection(srv.getsockname()); peer, _ = srv.accept()\n"
                        "r, w = os.pipe(); os.set_blocking(r, False)\n"
                        "open('/tmp/slowmod.py', 'w').write(\n"
                        "    'import os, time\\nwhile not os.path.exists(\"/tmp/go\"):\\n    time.sleep(0.01)\\nvalue = 7\\n')\n"
                        "sys.path.insert(0, '/tmp')\n"
                        "importer = threading.Thread(target=__import__, args=('slowmod',), name='importer', daemon=True)\n"
                        "importer.start()\n"
                        "deadline = time.time() + 30\n"
                        "while 'slowmod' not in sys.modules and time.time() < deadline:\n    time.sleep(0.01)\n"
                        "assert 'slowmod' in sys.modules")
    snap, (g1, g2) = branch_and_spawn(vm_engine, src, kids, "work-carried")
    try:
        # asyncio: the idle loop runs in the copy; the pending task goes on there and ends there only
        assert ev(vm_engine, g1, "loop.run_until_complete(twice(21))") == "42"
        assert ev(vm_engine, g1, "task.done()") == "False"
        run(vm_engine, g1, "fut.set_result(5)")
        assert ev(vm_engine, g1, "loop.run_until_complete(task)") == "50"
        for other in (g2, src):
            assert ev(vm_engine, other, "(loop.run_until_complete(asyncio.sleep(0)), task.done())") == "(None, False)"
        # sockets: the pair and the connection are the copy's own; the listener accepts there
        run(vm_engine, g1, "left.sendall(b'pair'); cli.sendall(b'conn')\n"
                           "late = socket.create_connection(srv.getsockname()); late_peer, _ = srv.accept()\n"
                           "late.sendall(b'late'); os.write(w, b'pipe')")
        assert ev(vm_engine, g1, "right.recv(10), peer.recv(10), late_peer.recv(10), os.read(r, 10)") \
            == "(b'pair', b'conn', b'late', b'pipe')"
        for other in (g2, src):
            assert ev(vm_engine, other, "[s.setblocking(False) for s in (right, peer)] and None") == "None"
            for read in ("right.recv(10)", "peer.recv(10)", "os.read(r, 10)"):
                reply = vm_engine.call(other, {"action": "run_code", "code": read}, timeout=60)
                assert reply["error"]["ename"] == "BlockingIOError", reply  # nothing of g1's reached it
        # the import another thread had begun completes in the copy
        run(vm_engine, g1, "open('/tmp/go', 'w').close()\nimporter.join(30)\nimport slowmod", timeout=40)
        assert ev(vm_engine, g1, "importer.is_alive(), slowmod.value") == "(False, 7)"
        assert ev(vm_engine, g2, "os.path.exists('/tmp/go'), importer.is_alive()") == "(False, True)"
    finally:
        vm_engine.delete_snapshot(snap)


def test_generators_made_without_a_seed_draw_their_own_numbers_in_every_copy(vm_engine, np_snap, kids):
    a, b = spawn(vm_engine, np_snap, kids, n=2)
    streams.assert_own(streams.DRAWS, *(ev(vm_engine, h, streams.DRAW) for h in (a, b)))
    # made in a sandbox before a branch: the branch's children (copies of a copy) get their own again
    run(vm_engine, a, streams.LATER_CODE)
    snap = vm_engine.branch(a, "generators", ["numpy", "a", "generators"], "full").ready.result(120)
    try:
        g1, g2 = spawn(vm_engine, snap, kids, n=2, prefix="g")
        streams.assert_own(streams.ALL, *(ev(vm_engine, h, streams.DRAW_ALL) for h in (g1, g2, a)))
    finally:
        vm_engine.delete_snapshot(snap)
