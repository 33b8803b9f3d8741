"""A fork or branch is never silently wrong (process engine): each test is one row of the table
"What a fork carries" in README.md, asserting what the user sees in the copy and in its source."""

from __future__ import annotations

import ast
import concurrent.futures
import re
import threading

import pytest

from forkd_server.errors import ForkdError

from .. import streams
from ..conftest import requires_root
from .conftest import ev, sh

pytestmark = requires_root


@pytest.fixture(scope="module")
def plain(ctl):
    return ctl.create_snapshot("plain", setup="import os, sys, tempfile, threading, subprocess, mmap, time")["tag"]


def run(ctl, sandbox_id: str, code: str, timeout: float = 60) -> dict:
    reply = ctl.run_code(sandbox_id, code, timeout=timeout)
    assert reply["exit_code"] == 0, reply
    return reply


def branch_and_fork(ctl, source: str, n: int = 2, **options) -> list[str]:
    tag = ctl.branch(source, **options)["tag"]
    return [s["id"] for s in ctl.spawn(tag, n)]


# --- files ---------------------------------------------------------------------------------------

def test_relative_paths_are_private_to_each_fork(ctl, plain):
    a, b = (s["id"] for s in ctl.spawn(plain, 2))
    run(ctl, a, "open('x.txt', 'w').write('written by a')")
    assert ev(ctl, b, "os.path.exists('x.txt')") == "False"                   # a sibling does not see it
    later = ctl.spawn(plain, 1)[0]["id"]
    assert ev(ctl, later, "os.path.exists('x.txt')") == "False"               # nor does a later child
    assert "x.txt" in {e["name"] for e in ctl.files(a, "list", "/tmp")["entries"]}  # its own /tmp shows it
    assert "x.txt" in sh(ctl, a, "ls /tmp")["stdout"].split()


def test_cwd_follows_into_the_branch_with_its_own_copy(ctl, plain):
    src = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, src, "os.makedirs('/tmp/work/sub', exist_ok=True); os.chdir('/tmp/work/sub')\n"
                  "open('notes.txt', 'w').write('from source')")
    g1, g2 = branch_and_fork(ctl, src)
    assert ev(ctl, g1, "os.getcwd()") == "'/tmp/work/sub'"
    assert ev(ctl, g1, "open('notes.txt').read()") == "'from source'"
    run(ctl, g1, "open('notes.txt', 'w').write('from g1')")
    assert ev(ctl, g2, "open('notes.txt').read()") == "'from source'"
    assert ev(ctl, src, "open('notes.txt').read()") == "'from source'"


def test_open_file_objects_write_into_the_forks_own_copy(ctl, plain):
    src = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, src, "log = open('/tmp/log.txt', 'a'); log.write('source\\n'); log.flush()")
    g1, g2 = branch_and_fork(ctl, src)
    run(ctl, g1, "log.write('g1\\n'); log.flush()")
    assert ev(ctl, g1, "open('/tmp/log.txt').read()") == repr("source\ng1\n")
    assert ev(ctl, g2, "open('/tmp/log.txt').read()") == repr("source\n")
    assert ev(ctl, src, "open('/tmp/log.txt').read()") == repr("source\n")
    assert ctl.ping(g1)["pong"] is True  # the file object never aliases the agent's own socket


def test_a_temporary_file_is_copied_into_each_fork(ctl, plain):
    src = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, src, "tf = tempfile.TemporaryFile(); tf.write(b'kept'); tf.flush()")
    g1, g2 = branch_and_fork(ctl, src)
    run(ctl, g1, "tf.seek(0); tf.write(b'CHANGED'); tf.flush()")
    assert ev(ctl, g2, "(tf.seek(0), tf.read())[1]") == "b'kept'"
    assert ev(ctl, src, "(tf.seek(0), tf.read())[1]") == "b'kept'"


def test_dev_shm_is_copied_like_tmp(ctl, plain):
    src = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, src, "open('/dev/shm/state', 'w').write('in shm')")
    g1, g2 = branch_and_fork(ctl, src)
    assert ev(ctl, g1, "open('/dev/shm/state').read()") == "'in shm'"
    run(ctl, g1, "open('/dev/shm/state', 'w').write('g1')")
    assert ev(ctl, g2, "open('/dev/shm/state').read()") == "'in shm'"
    assert ev(ctl, src, "open('/dev/shm/state').read()") == "'in shm'"


def test_shared_mappings_are_the_forks_own(ctl, plain):
    src = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, src, "f = open('/tmp/shared.bin', 'w+b'); f.write(bytes(4096)); f.flush()\n"
                  "m = mmap.mmap(f.fileno(), 4096); m[:5] = b'SRC00'\n"      # a file, MAP_SHARED
                  "anon = mmap.mmap(-1, 4096); anon[:3] = b'src'")            # anonymous, MAP_SHARED
    g1, g2 = branch_and_fork(ctl, src)
    assert ev(ctl, g1, "bytes(m[:5]), bytes(anon[:3])") == "(b'SRC00', b'src')"
    run(ctl, g1, "m[:5] = b'GRAND'; m.flush(); anon[:3] = b'g1!'")
    assert ev(ctl, g1, "open('/tmp/shared.bin', 'rb').read(5)") == "b'GRAND'"
    for other in (g2, src):
        assert ev(ctl, other, "bytes(m[:5]), bytes(anon[:3])") == "(b'SRC00', b'src')"
        assert ev(ctl, other, "open('/tmp/shared.bin', 'rb').read(5)") == "b'SRC00'"


def test_multiprocessing_shared_memory_refuses_for_its_tracker_and_is_the_forks_own_when_lossy(ctl, plain):
    src = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, src, "from multiprocessing import shared_memory\n"
                  "sm = shared_memory.SharedMemory(create=True, size=4096); sm.buf[:3] = b'src'")
    # the mapping could be copied, but multiprocessing's resource tracker is a process a fork drops
    assert "multiprocessing.resource_tra" in refused(ctl, src)
    branch = ctl.branch(src, lossy=True)
    assert any("child process" in w for w in branch["warnings"])
    g1, g2 = (s["id"] for s in ctl.spawn(branch["tag"], 2))
    run(ctl, g1, "sm.buf[:3] = b'g1!'")
    for other in (g2, src):
        assert ev(ctl, other, "bytes(sm.buf[:3]), open('/dev/shm/' + sm.name, 'rb').read(3)") == "(b'src', b'src')"
    assert run(ctl, g1, "sm.close(); sm.unlink()")["exit_code"] == 0  # the copy starts its own tracker


# --- processes and names -------------------------------------------------------------------------

def test_exit_statuses_belong_to_the_users_code(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    reply = run(ctl, sb, "codes = []\n"
                         "for _ in range(20):\n"
                         "    p = subprocess.Popen(['sh', '-c', 'exit 3'])\n"
                         "    time.sleep(0.02)\n"                           # exited before poll()
                         "    codes.append(p.wait())\n"
                         "fails = 0\n"
                         "for _ in range(20):\n"
                         "    try:\n"
                         "        subprocess.check_output(['false'])\n"
                         "    except subprocess.CalledProcessError:\n"
                         "        fails += 1\n"
                         "set(codes), fails")
    assert reply["result"]["text/plain"] == "({3}, 20)"


def test_orphans_are_still_reaped(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    # A shell that exits at once leaves its background child to PID 1 (the agent).
    sh(ctl, sb, "sleep 0.2 & exit 0")
    reply = run(ctl, sb, "import glob\n"
                         "deadline = time.time() + 10\n"
                         "def zombies():\n"
                         "    return [p for p in glob.glob('/proc/[0-9]*/stat') if open(p).read().split(') ')[1][0] == 'Z']\n"
                         "time.sleep(0.5)\n"
                         "while zombies() and time.time() < deadline:\n"
                         "    time.sleep(0.05)\n"
                         "zombies()")
    assert reply["result"]["text/plain"] == "[]"


def test_tempfile_names_differ_between_siblings(ctl, plain):
    base = ctl.create_snapshot("tempnames", setup="import tempfile\nfirst = tempfile.mkdtemp()")["tag"]
    kids = [s["id"] for s in ctl.spawn(base, 3)]
    names = {ev(ctl, k, "[tempfile.mkdtemp() for _ in range(3)]") for k in kids}
    assert len(names) == 3


def test_every_sandbox_has_its_own_machine_id(ctl):
    with open("/etc/machine-id") as f:
        host = f.read()
    base = ctl.create_snapshot("machine-ids", setup="import os\nseen_in_setup = open('/etc/machine-id').read()")["tag"]
    a, b = (s["id"] for s in ctl.spawn(base, 2))
    read = "open('/etc/machine-id').read()"
    ids = [ast.literal_eval(ev(ctl, s, read)) for s in (a, b)]
    assert all(re.fullmatch(r"[0-9a-f]{32}\n", i) for i in ids), ids   # systemd's format
    setup_saw = ast.literal_eval(ev(ctl, a, "seen_in_setup"))
    assert len({host, setup_saw, *ids}) == 4                              # the host's, the setup's, each its own
    assert ast.literal_eval(ev(ctl, a, read)) == ids[0]                   # and it stays the sandbox's
    for path in ("/etc/machine-id", "/run/machine-id", "/run/other"):
        assert "Read-only file system" in sh(ctl, a, f"echo x > {path}")["stderr"], path
    assert ev(ctl, a, "os.listdir('/run')") == "['machine-id']"           # as systemd has it on a read-only /etc
    g1, g2 = branch_and_fork(ctl, a)
    branched = {ast.literal_eval(ev(ctl, g, read)) for g in (g1, g2)}
    assert len(branched) == 2 and not branched & {host, *ids}


def test_generators_made_without_a_seed_draw_their_own_numbers_in_every_copy(ctl):
    base = ctl.create_snapshot("generators", setup=streams.SETUP)["tag"]
    a, b = (s["id"] for s in ctl.spawn(base, 2))
    draws = [ev(ctl, s, streams.DRAW) for s in (a, b)]
    streams.assert_own(streams.DRAWS, *draws)
    # Made in a sandbox before a branch, or from a sequence the setup made: the branch's children
    # (copies of a copy) get their own streams again; seeded ones still agree.
    run(ctl, a, streams.LATER_CODE)
    g1, g2 = branch_and_fork(ctl, a)
    streams.assert_own(streams.ALL, *(ev(ctl, s, streams.DRAW_ALL) for s in (g1, g2, a)))


# --- running work: refused, or carried with warnings -----------------------------------------------

def refused(ctl, source: str) -> str:
    with pytest.raises(ForkdError) as info:
        ctl.branch(source)
    error = info.value
    assert error.status == 409 and "lossy fork" in error.hint and "VM engine" in error.hint
    assert error.details["rest"] == '"lossy": true' and 'engine "vm"' in error.details["vm"]
    assert error.details["lost"] == error.fields["lost"] and error.details["lost"][0] in error.what
    return "\n".join(error.details["lost"])


def test_a_running_thread_refuses_the_branch_or_becomes_a_warning(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, sb, "stop = threading.Event()\n"
                 "def monitor():\n    stop.wait()\n"
                 "threading.Thread(target=monitor, name='tqdm-monitor', daemon=True).start()")
    assert "thread 'tqdm-monitor' (monitor) is running" in refused(ctl, sb)
    branch = ctl.branch(sb, lossy=True)
    assert any("tqdm-monitor" in w for w in branch["warnings"])
    g = ctl.spawn(branch["tag"], 1)[0]["id"]
    assert ev(ctl, g, "[t.name for t in threading.enumerate() if t.name == 'tqdm-monitor']") == "[]"


def test_a_child_process_refuses_the_branch_and_is_reported_killed_in_a_lossy_one(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, sb, "server = subprocess.Popen(['sleep', '600'])")
    assert "child process running" in refused(ctl, sb) and "sleep 600" in refused(ctl, sb)
    branch = ctl.branch(sb, lossy=True)
    g = ctl.spawn(branch["tag"], 1)[0]["id"]
    assert ev(ctl, g, "server.poll()") == "-9"  # never 0: the process does not exist here
    assert ev(ctl, sb, "server.poll()") == "None"  # still running in the source
    run(ctl, sb, "server.kill(); server.wait()")


def test_a_forked_process_refuses_the_branch_like_any_other(ctl, plain):
    """os.fork() and multiprocessing (fork start method) children never exec: their memory stays
    owned by the host's user namespace, and /proc/N/ns/pid is closed to the sandbox. The inventory
    must see them all the same."""
    sb = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, sb, "import multiprocessing\n"
                 "worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(600,))\n"
                 "worker.start()\n"
                 "forked = os.fork()\n"
                 "if forked == 0:\n    time.sleep(600)\n    os._exit(0)")
    said = refused(ctl, sb)
    assert "2 child processes running" in said and "a fork of this Python" in said, said
    run(ctl, sb, "worker.kill(); worker.join(); worker.close(); os.kill(forked, 9); os.waitpid(forked, 0)")
    assert ctl.branch(sb)["status"] == "ready"  # nothing left running: exact again


def test_pending_asyncio_tasks_refuse_the_branch(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, sb, "import asyncio\n"
                 "loop = asyncio.new_event_loop()\n"
                 "async def forever():\n    await asyncio.sleep(3600)\n"
                 "task = loop.create_task(forever())")
    assert "1 asyncio task pending (forever)" in refused(ctl, sb)


def test_an_idle_event_loop_is_renewed_and_works_in_the_copy(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, sb, "import asyncio\nloop = asyncio.new_event_loop()\nasyncio.set_event_loop(loop)\n"
                 "async def twice(x):\n    await asyncio.sleep(0.01)\n    return 2 * x\n"
                 "loop.run_until_complete(twice(1))")
    g1, g2 = branch_and_fork(ctl, sb)
    assert ev(ctl, g1, "loop.run_until_complete(twice(21))") == "42"
    assert ev(ctl, sb, "loop.run_until_complete(twice(4))") == "8"


def test_a_users_socket_refuses_the_branch_and_is_closed_in_a_lossy_one(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, sb, "import socket\nsrv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()\n"
                 "cli = socket.create_connection(srv.getsockname()); peer, _ = srv.accept()\n"
                 "r, w = os.pipe(); os.set_blocking(r, False)")
    assert "open sockets" in refused(ctl, sb)
    g = ctl.spawn(ctl.branch(sb, lossy=True)["tag"], 1)[0]["id"]
    reply = ctl.run_code(g, "cli.send(b'hello from the copy')")
    assert reply["error"]["ename"] in ("BrokenPipeError", "OSError")  # loud, never the source's peer
    nothing = ctl.run_code(sb, "peer.setblocking(False)\npeer.recv(100)")  # the source's peer got nothing
    assert nothing["error"]["ename"] == "BlockingIOError", nothing
    # the pipe: in the copy its read end is at end-of-file and its write end refuses writes
    assert ev(ctl, g, "os.read(r, 10)") == "b''"
    assert ctl.run_code(g, "os.write(w, b'from the copy')")["error"]["ename"] == "OSError"
    assert ctl.run_code(sb, "os.read(r, 10)")["error"]["ename"] == "BlockingIOError"  # nothing reached the source


@pytest.mark.parametrize("call", ["ping", "eval"])
def test_the_agents_own_connections_never_refuse_a_branch(ctl, plain, call):
    """Requests the API sends the sandbox meanwhile (pings or evals on six threads) are the agent's
    own sockets, never the user's: 40 full branches of the idle sandbox all go through."""
    sb = ctl.spawn(plain, 1)[0]["id"]
    stop = threading.Event()
    pings = [0] * 6

    def ping(i):
        while not stop.is_set():
            if call == "ping":
                assert ctl.ping(sb)["pong"] is True
            else:
                assert ev(ctl, sb, "1") == "1"
            pings[i] += 1

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        pingers = [pool.submit(ping, i) for i in range(6)]
        refusals, tags = [], []
        try:
            for _ in range(40):
                try:
                    tags.append(ctl.branch(sb)["tag"])
                except ForkdError as exc:
                    refusals.append(exc.what)
        finally:
            stop.set()
        for p in pingers:
            p.result()
    for tag in tags:
        ctl.delete_snapshot(tag)
    assert min(pings) > 0  # every thread pinged while the branches ran
    assert refusals == [], f"{len(refusals)} of 40 branches refused: {refusals[0]}"


def test_an_import_cut_short_by_a_lossy_fork_runs_again_in_the_copy(ctl, plain):
    sb = ctl.spawn(plain, 1)[0]["id"]
    run(ctl, sb, "open('/tmp/slowmod.py', 'w').write(\n"
                 "    'import os, time\\nwhile not os.path.exists(\"/tmp/go\"):\\n    time.sleep(0.01)\\nvalue = 7\\n')\n"
                 "sys.path.insert(0, '/tmp')\n"
                 "importer = threading.Thread(target=__import__, args=('slowmod',), name='importer', daemon=True)\n"
                 "importer.start()\n"
                 "while 'slowmod' not in sys.modules:\n    time.sleep(0.01)")
    assert "importing slowmod" in refused(ctl, sb)
    g = ctl.spawn(ctl.branch(sb, lossy=True)["tag"], 1)[0]["id"]
    reply = ctl.run_code(g, "open('/tmp/go', 'w').close()\nimport slowmod\nslowmod.value", timeout=20)
    assert reply["exit_code"] == 0, reply
    assert reply["result"]["text/plain"] == "7"
    sh(ctl, sb, "touch /tmp/go")


def test_setup_that_leaves_a_thread_running_is_refused_unless_lossy(ctl):
    setup = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), name='warmup', daemon=True).start()"
    with pytest.raises(ForkdError) as info:
        ctl.create_snapshot("leaves-thread", setup=setup)
    assert info.value.status == 409 and "thread 'warmup'" in info.value.message
    assert all(s["tag"] != "leaves-thread" for s in ctl.list_snapshots())
    # lossy: the snapshot is made and its children lack the thread
    ctl.create_snapshot("leaves-thread", setup=setup, lossy=True)
    kid = ctl.spawn("leaves-thread", 1)[0]["id"]
    assert ev(ctl, kid, "[t.name for t in threading.enumerate() if t.name == 'warmup']") == "[]"


def test_a_lossy_setup_snapshot_lists_what_its_children_lack(ctl):
    setup = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), name='warmup2', daemon=True).start()"
    snap = ctl.create_snapshot("leaves-thread-listed", setup=setup, lossy=True)
    assert any("thread 'warmup2'" in w for w in snap.get("warnings", []))       # the reply says so
    assert ctl.get_snapshot("leaves-thread-listed")["warnings"] == snap["warnings"]  # and the snapshot keeps it
    assert "warnings" not in ctl.registry.get_snapshot("leaves-thread-listed")["handle"]
    plain_snap = ctl.create_snapshot("leaves-nothing", setup="x = 1", lossy=True)
    assert not plain_snap.get("warnings")  # lossy allowed, nothing left: nothing to warn of
