"""A branch is a save point: it outlives whatever ends the sandbox it was taken from.

For every way a sandbox's Python can die (a kill -9 from the host, the OOM killer at its memory
limit, its huge-page cap, os.abort(), a segfault, os._exit, a wedge at its pids limit), a sandbox
with two branches and a running grandchild dies that way; both branches then spawn children that
hold its state, the grandchild still answers, the source's 410 or 404 says how it died, and once
everything nested in it is gone its init (forkd-init, PID 1 of its pid namespace) is gone too.
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from forkd_server.errors import Gone, NotFound

from ..conftest import requires_root, wait_gone
from .conftest import ev

pytestmark = requires_root

STATE = "saved = 'keep-me'\nimport numpy as np\nweights = np.arange(10**6)"

# A cell that touches 64 huge pages (128 MiB) through a mapping that reserves none: past a 64 MiB
# cap the 33rd page is refused, and the agent gets SIGBUS.
HUGE_PAGE_TOUCH = """
import mmap
m = mmap.mmap(-1, 128 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000 | 0x4000)
for i in range(64):
    m[i << 21] = 1
"""

FORK_BOMB = """
import os, time
forks = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
        forks += 1
except BlockingIOError:
    pass
forks
"""

# way -> (memory limit of the source, the cell that ends it or None, what its end says)
WAYS = {
    "kill -9 from the host": (None, None, r"its Python was killed by SIGKILL from outside forkd"),
    "the OOM killer at its memory limit": (128, "hog = b'x' * (400 << 20)", r"it died of its memory limit \(128 MiB\)"),
    "its huge-page cap": (64, HUGE_PAGE_TOUCH, r"it died of its huge-page cap \(64 MiB"),
    "os.abort()": (None, "import os\nos.abort()", r"its Python aborted \(SIGABRT"),
    "a segfault in C code": (None, "import ctypes\nctypes.string_at(0)", r"its Python crashed with SIGSEGV"),
    "os._exit(3)": (None, "import os\nos._exit(3)", r"its Python exited with status 3"),
    "a wedge at its pids limit, then kill -9": (None, FORK_BOMB, r"SIGKILL(.|\n)*run fewer processes and threads"),
}


@pytest.fixture(scope="module")
def numpy_snap(ctl):
    return ctl.create_snapshot("sp", setup="import numpy as np")["tag"]


@pytest.mark.parametrize("way", list(WAYS))
def test_branches_outlive_their_source(ctl, numpy_snap, way):
    limit, cell, says = WAYS[way]
    if way == "its huge-page cap" and not ctl.engines["process"].huge_pages:
        pytest.skip(f"huge pages cannot be capped on this host: {ctl.engines['process'].huge_pages_note}")
    engine = ctl.engines["process"]
    source = ctl.spawn(numpy_snap, 1, **({"memory_limit_mib": limit} if limit else {}))[0]
    handle = ctl.registry.get_sandbox(source["id"])["handle"]
    made_sandboxes, made_snapshots = [], []
    try:
        assert ctl.run_code(source["id"], STATE)["exit_code"] == 0
        full = ctl.branch(source["id"], mode="full")["tag"]
        live = ctl.branch(source["id"], mode="live")["tag"]
        made_snapshots += [full, live]
        grandchild = ctl.spawn(full, 1)[0]["id"]
        made_sandboxes.append(grandchild)

        if way == "kill -9 from the host":
            os.kill(source["pid"], signal.SIGKILL)  # the pid GET /v1/sandboxes/{id} gives
            assert engine.wait_exit(handle, 30)
            with pytest.raises(NotFound, match=says):
                ctl.get_sandbox(source["id"])
        elif way.startswith("a wedge"):
            assert int(ctl.run_code(source["id"], cell, timeout=120)["result"]["text/plain"]) > 900
            os.kill(source["pid"], signal.SIGKILL)  # what a user does to a wedged sandbox
            assert engine.wait_exit(handle, 30)
            with pytest.raises(NotFound, match=says):
                ctl.get_sandbox(source["id"])
        else:
            with pytest.raises(Gone, match=says):  # the call it died during
                ctl.run_code(source["id"], cell, timeout=120)
            with pytest.raises(NotFound, match=says):  # and its id afterwards
                ctl.get_sandbox(source["id"])

        assert ev(ctl, grandchild, "saved") == "'keep-me'"  # the running grandchild goes on
        for tag in (full, live):
            assert ctl.get_snapshot(tag)["status"] == "ready"
            kid = ctl.spawn(tag, 1)[0]["id"]
            made_sandboxes.append(kid)
            assert ev(ctl, kid, "saved") == "'keep-me'"
            assert ev(ctl, kid, "int(weights.sum())") == str(sum(range(10**6)))
    finally:
        for sandbox_id in made_sandboxes:
            ctl.kill_sandbox(sandbox_id)
        for tag in made_snapshots:
            ctl.delete_snapshot(tag)
        if source["id"] in {s["id"] for s in ctl.list_sandboxes()}:
            ctl.kill_sandbox(source["id"])
    # nothing nested in its namespace lives any more: its init has gone (and every process it held)
    assert wait_gone({handle["init"]["pid"]}) == set()


def test_a_template_killed_from_outside_leaves_its_sandboxes_running(ctl):
    ctl.create_snapshot("tk", setup="v = 5")
    kids = ctl.spawn("tk", 2)
    template = ctl.registry.get_snapshot("tk")["handle"]
    try:
        os.kill(template["pid"], signal.SIGKILL)
        assert ctl.engines["process"].wait_exit(template, 30)
        info = ctl.get_snapshot("tk")
        assert info["status"] == "failed"
        assert "its Python was killed by SIGKILL from outside forkd" in info["warning"]
        assert [ev(ctl, k["id"], "v") for k in kids] == ["5", "5"]  # nested in it, and running
    finally:
        for k in kids:
            ctl.kill_sandbox(k["id"])
        ctl.delete_snapshot("tk")
    assert wait_gone({template["init"]["pid"]}) == set()


def test_init_is_pid_1_and_the_agent_its_child(ctl, numpy_snap):
    sb = ctl.spawn(numpy_snap, 1)[0]
    try:
        handle = ctl.registry.get_sandbox(sb["id"])["handle"]
        with open(f"/proc/{handle['init']['pid']}/comm") as f:
            assert f.read().strip() == "forkd-init"
        assert ev(ctl, sb["id"], "__import__('os').getpid()") == "2"
        assert ev(ctl, sb["id"], "__import__('os').getppid()") == "1"
        # a few pages of its own, paid once per sandbox (its code is one file every init shares)
        with open(f"/proc/{handle['init']['pid']}/smaps_rollup") as f:
            anonymous = next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))
        assert anonymous < 256, f"forkd-init holds {anonymous} KiB of anonymous memory"
    finally:
        ctl.kill_sandbox(sb["id"])


# Signal every process the cell can see, and a child of its own first; ``outcome``: whether that
# child was hit and how it ended, the errnos of the refusals, how many.
KILL_ALL_VISIBLE = """
import errno, os, signal, subprocess
own = subprocess.Popen(["sleep", "600"])
me, hit, refused = os.getpid(), [], {}
for name in os.listdir('/proc'):
    if name.isdigit() and int(name) not in (1, me):
        try:
            os.kill(int(name), signal.SIGKILL)
            hit.append(int(name))
        except OSError as exc:
            refused[int(name)] = errno.errorcode[exc.errno]
own.wait()
outcome = (own.pid in hit, own.returncode, sorted(set(refused.values())), len(refused))
"""

# Every other way to signal a process by number, aimed at ``target``; ``got``: how each ended.
OTHER_WAYS = """
import ctypes, errno, fcntl, os, signal, socket
def outcome(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode[exc.errno]
libc = ctypes.CDLL(None, use_errno=True)
def raw(nr, *args):
    if libc.syscall(nr, *args) < 0:
        raise OSError(ctypes.get_errno(), "")
a, b = socket.socketpair()
got = {
    "kill(-1)": outcome(lambda: os.kill(-1, signal.SIGKILL)),
    "tgkill": outcome(lambda: raw(234, target, target, signal.SIGKILL)),
    "tkill": outcome(lambda: raw(200, target, signal.SIGKILL)),
    "rt_sigqueueinfo": outcome(lambda: raw(129, target, signal.SIGKILL, ctypes.create_string_buffer(128))),
    "F_SETOWN": outcome(lambda: fcntl.fcntl(a, fcntl.F_SETOWN, target)),
    "pidfd_send_signal": outcome(lambda: signal.pidfd_send_signal(os.pidfd_open(target), signal.SIGKILL)),
    "kill(own group)": outcome(lambda: os.kill(0, 0)),
    "kill(self, 0)": outcome(lambda: os.kill(os.getpid(), 0)),
    "kill(nothing)": outcome(lambda: os.kill(4000000, 0)),
}
"""


def run(ctl, sandbox_id: str, cell: str, name: str) -> str:
    """Run ``cell`` in the sandbox; the repr of its variable ``name``."""
    assert ctl.run_code(sandbox_id, cell)["exit_code"] == 0
    return ev(ctl, sandbox_id, name)


def test_a_sandbox_cannot_kill_its_branch_or_what_was_spawned_from_it(ctl, numpy_snap):
    """The sandbox's user code signals every process it can see, after a branch that has a running
    child: its own child ends, each process of the branch refuses (EPERM), and the branch (a
    template) and its child go on. Its grandchild may end its own child too."""
    source = ctl.spawn(numpy_snap, 1)[0]["id"]
    tag = None
    kids = []
    try:
        assert ctl.run_code(source, STATE)["exit_code"] == 0
        tag = ctl.branch(source)["tag"]
        kids.append(ctl.spawn(tag, 1)[0]["id"])
        # the branch's init and template, the child's init and agent: four processes refused
        assert run(ctl, source, KILL_ALL_VISIBLE, "outcome") == "(True, -9, ['EPERM'], 4)"
        assert ev(ctl, kids[0], "saved") == "'keep-me'"  # the branch's child still answers
        kids.append(ctl.spawn(tag, 1)[0]["id"])  # and the branch still spawns
        assert ev(ctl, kids[1], "saved") == "'keep-me'"
        assert ctl.get_snapshot(tag)["status"] == "ready"
        assert run(ctl, kids[1], KILL_ALL_VISIBLE, "outcome") == "(True, -9, [], 0)"  # nothing nested in it yet
    finally:
        for sandbox_id in kids + [source]:
            with contextlib.suppress(NotFound):  # what the kill reached has ended already
                ctl.kill_sandbox(sandbox_id)
        if tag is not None:
            ctl.delete_snapshot(tag)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the cell names x86_64's syscall numbers")
def test_no_other_signal_call_reaches_a_branch(ctl, numpy_snap):
    """kill(-1), tgkill, tkill, rt_sigqueueinfo and F_SETOWN aimed at the branch's template are
    refused, pidfd_send_signal is not there (callers fall back to kill); the branch spawns after."""
    source = ctl.spawn(numpy_snap, 1)[0]["id"]
    tag = ctl.branch(source)["tag"]
    try:
        def nspid(pid: int) -> list[str]:
            with open(f"/proc/{pid}/status") as f:
                return next(line.split()[1:] for line in f if line.startswith("NSpid:"))
        level = len(nspid(ctl.registry.get_sandbox(source)["handle"]["pid"])) - 1
        target = nspid(ctl.registry.get_snapshot(tag)["handle"]["pid"])[level]  # as the source names it
        got = eval(run(ctl, source, f"target = {target}\n" + OTHER_WAYS, "got"))  # noqa: S307 - a dict of strings
        assert got == {"kill(-1)": "EPERM", "tgkill": "EPERM", "tkill": "EPERM", "rt_sigqueueinfo": "EPERM",
                       "F_SETOWN": "EPERM", "pidfd_send_signal": "ENOSYS", "kill(own group)": "done",
                       "kill(self, 0)": "done", "kill(nothing)": "ESRCH"}
        child = ctl.spawn(tag, 1)[0]["id"]
        assert ev(ctl, child, "1 + 1") == "2"
        ctl.kill_sandbox(child)
    finally:
        ctl.kill_sandbox(source)
        ctl.delete_snapshot(tag)


def test_a_group_signal_reaches_no_sibling_and_no_template(ctl, numpy_snap):
    """Each sandbox is a session of its own: ``os.killpg(os.getpgrp(), SIGKILL)`` ends the sandbox
    itself, not the snapshot's template or its siblings (they shared one group once)."""
    first, second = (kid["id"] for kid in ctl.spawn(numpy_snap, 2))
    try:
        with pytest.raises(Gone, match="killed by SIGKILL"):
            ctl.run_code(first, "import os, signal\nos.killpg(os.getpgrp(), signal.SIGKILL)")
        assert ev(ctl, second, "1 + 1") == "2"
        assert ctl.get_snapshot(numpy_snap)["status"] == "ready"
        third = ctl.spawn(numpy_snap, 1)[0]["id"]
        ctl.kill_sandbox(third)
    finally:
        for sandbox_id in (first, second):
            with contextlib.suppress(NotFound):
                ctl.kill_sandbox(sandbox_id)
