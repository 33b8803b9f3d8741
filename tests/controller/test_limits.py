"""Resource limits and the seccomp filter, seen from inside a sandbox."""

from __future__ import annotations

import os
import signal

import pytest

from forkd_server.errors import Gone, NotFound

from ..conftest import requires_root
from ..signals import signal_main_thread_until
from .conftest import ev, sh

pytestmark = requires_root


def test_memory_limit_kills_an_overgrown_sandbox_process(ctl, snap):
    sb = ctl.spawn(snap, 1, memory_limit_mib=128)[0]
    leaf = next(p for p in sb_cgroups(ctl, sb["id"]) if "memory" in p)
    with open(os.path.join(leaf, "memory.limit_in_bytes" if "/memory/" in leaf else "memory.max")) as f:
        assert int(f.read()) == 128 * 2**20
    out = ctl.exec(sb["id"], ["python3", "-c", "b = bytearray(400 * 2**20); print(len(b))"])
    assert out["exit_code"] == -9 and out["stdout"] == ""
    # the command died, the sandbox lives on
    assert ctl.get_sandbox(sb["id"])["memory_limit_mib"] == 128
    assert ctl.ping(sb["id"])["pong"] is True


def test_a_raised_memory_limit_lets_a_running_sandbox_hold_more_and_is_never_lowered(ctl, snap):
    from forkd_server.errors import Conflict

    sb = ctl.spawn(snap, 1, memory_limit_mib=128)[0]["id"]
    assert ctl.run_code(sb, "kept = 'state'")["exit_code"] == 0
    leaf = next(p for p in sb_cgroups(ctl, sb) if os.path.exists(os.path.join(p, memory_file(p))))
    assert ctl.update_sandbox(sb, memory_limit_mib=512)["memory_limit_mib"] == 512
    with open(os.path.join(leaf, memory_file(leaf))) as f:
        assert int(f.read()) == 512 * 2**20
    # 300 MiB in the sandbox's own agent: past the limit it was made with, within the new one
    assert ctl.run_code(sb, "blob = b'x' * (300 * 2**20)")["exit_code"] == 0
    assert ev(ctl, sb, "(len(blob) >> 20, kept)") == "(300, 'state')"
    with pytest.raises(Conflict, match=r"\(512 MiB\) can only be raised"):
        ctl.update_sandbox(sb, memory_limit_mib=256)
    assert ctl.get_sandbox(sb)["memory_limit_mib"] == 512  # a refused change changes nothing


def memory_file(leaf: str) -> str:
    return "memory.max" if os.path.exists(os.path.join(leaf, "cgroup.controllers")) else "memory.limit_in_bytes"


def test_a_sandbox_killed_by_its_memory_limit_says_so(ctl, snap):
    """Its cell's call answers 410, its id 404, its killed event: each names the memory limit
    (64 MiB) in one line and how to raise it in the next, the kernel's counters and the fix in each
    front end's words in its details. Before, the sandbox just vanished ("not found")."""
    sb = ctl.spawn(snap, 1, memory_limit_mib=64)[0]["id"]
    leaves = sb_cgroups(ctl, sb)
    events = []
    unsubscribe = ctl.subscribe(events.append)
    try:
        with pytest.raises(Gone) as during:  # the agent itself runs the eval: the OOM killer ends it
            ctl.eval(sb, "len(b'x' * (200 * 2**20))")
    finally:
        unsubscribe()
    assert during.value.fields["ended"]["reason"] == "it died of its memory limit (64 MiB)"
    assert during.value.message == (f"sandbox {sb} ended during this eval: it died of its memory limit (64 MiB)\n"
                                    f"to go on, start a sandbox of {snap} with a larger memory_limit_mib, e.g. 128")
    for details in (during.value.details, during.value.fields["details"]):
        assert "memory limit was reached (64 MiB)" in details["kernel"] and "OOM killer" in details["kernel"]
        assert details["rest"] == f'POST /v1/sandboxes {{"snapshot_tag": "{snap}", "memory_limit_mib": 128}}'
        assert details["cli"] == f"forkd spawn --tag {snap} --memory-limit-mib 128" and details["limit_mib"] == 64
    with pytest.raises(NotFound) as after:
        ctl.get_sandbox(sb)
    assert after.value.what == f"sandbox {sb} not found: it died of its memory limit (64 MiB)"
    assert after.value.hint == during.value.hint and "memory_limit_mib" in after.value.hint
    assert after.value.details["kernel"] == during.value.details["kernel"] and "ended_at" in after.value.details
    assert after.value.fields["ended"]["limit"] == "memory"
    (killed,) = [e for e in events if e["action"] == "killed" and e.get("id") == sb]
    assert killed["limit"] == "memory" and "64 MiB" in killed["reason"] and killed["hint"] == during.value.hint
    assert not any(os.path.exists(leaf) for leaf in leaves)  # its leaves went with it


def test_a_sandbox_that_dies_between_calls_says_why_at_its_next_one(ctl, snap):
    sb = ctl.spawn(snap, 1, memory_limit_mib=64)[0]["id"]
    row = ctl.registry.get_sandbox(sb)
    # a thread grows past the limit after the call has answered: when the test signals it
    grow = ("import signal, threading\ngo = threading.Event()\nsignal.signal(signal.SIGUSR1, lambda *_: go.set())\n"
            "threading.Thread(target=lambda: go.wait() and b'x' * (200 * 2**20), daemon=True).start()")
    assert ctl.run_code(sb, grow)["error"] is None
    engine = ctl.engines["process"]
    signal_main_thread_until(row["handle"]["pid"], signal.SIGUSR1, lambda: engine.wait_exit(row["handle"], 0.1),
                             "the sandbox dies of its memory limit")
    with pytest.raises(NotFound, match=r"it died of its memory limit \(64 MiB\)") as said:
        ctl.ping(sb)
    assert "memory limit was reached (64 MiB)" in said.value.details["kernel"]
    with pytest.raises(NotFound, match="it was killed"):  # and an ordinary kill says so too
        other = ctl.spawn(snap, 1)[0]["id"]
        ctl.kill_sandbox(other)
        ctl.get_sandbox(other)


def test_an_unexpected_end_says_how_and_that_no_limit_was_reached(ctl, snap):
    sb = ctl.spawn(snap, 1)[0]
    os.kill(sb["pid"], 9)
    assert ctl.engines["process"].wait_exit(ctl.registry.get_sandbox(sb["id"])["handle"], 30)
    with pytest.raises(NotFound, match="its Python was killed by SIGKILL from outside forkd") as gone:
        ctl.get_sandbox(sb["id"])
    assert gone.value.details["limits"] == "none of its limits was reached"


def sb_cgroups(ctl, sandbox_id):
    return ctl.registry.get_sandbox(sandbox_id)["handle"]["cgroups"]


def test_pids_limit_and_default_memory_limit(ctl, snap):
    sb = ctl.spawn(snap, 1)[0]
    leaves = sb_cgroups(ctl, sb["id"])
    leaf = next(p for p in leaves if os.path.exists(os.path.join(p, "pids.max")))
    with open(os.path.join(leaf, "pids.max")) as f:
        assert int(f.read()) == ctl.engines["process"].pids_max
    # no limit asked for: the engine's default applies, and the sandbox says so
    default = ctl.engines["process"].default_memory_limit_mib
    assert sb["memory_limit_mib"] == default == 2048
    leaf = next(p for p in leaves if "memory" in p)
    with open(os.path.join(leaf, "memory.limit_in_bytes" if "/memory/" in leaf else "memory.max")) as f:
        assert int(f.read()) == default * 2**20


def test_seccomp_denies_host_affecting_syscalls(ctl, snap):
    sb = ctl.spawn(snap, 1)[0]["id"]
    assert "Seccomp:\t2" in sh(ctl, sb, "cat /proc/self/status")["stdout"]
    probe = """
import ctypes, os

libc = ctypes.CDLL(None, use_errno=True)
def errno_of(nr, *args):
    r = libc.syscall(nr, *args)
    return 0 if r >= 0 else ctypes.get_errno()
# add_key (248) works for any unprivileged user without the filter; the filter answers EPERM
{'add_key': errno_of(248, b'user', b'k', b'v', 1, -3),
 'swapon': errno_of(167, b'/tmp/x', 0),
 'unshare_user': errno_of(272, 0x10000000),
 'clone3': errno_of(435, 0, 0)}
"""
    got = eval(ctl.run_code(sb, probe)["result"]["text/plain"])
    assert got == {"add_key": 1, "swapon": 1, "unshare_user": 1, "clone3": 38}  # EPERM, ENOSYS


def test_tmpfs_of_a_sandbox_is_private_memory_not_host_disk(ctl, snap):
    sb = ctl.spawn(snap, 1)[0]["id"]
    mounts = sh(ctl, sb, "cat /proc/self/mounts")["stdout"]
    tmp = [line for line in mounts.splitlines() if line.split()[1] == "/tmp"]
    assert tmp and tmp[-1].split()[2] == "tmpfs"


def tmpfs_mib(ctl, sandbox_id: str, path: str) -> int:
    out = sh(ctl, sandbox_id, f"df -m {path} | tail -1")["stdout"].split()
    return int(out[1])


def test_tmp_and_shm_sizes_follow_the_memory_limit(ctl, snap):
    """/tmp is half the sandbox's memory limit, /dev/shm a quarter (their files are memory charged
    to that limit): a full one says ENOSPC before the limit kills anything."""
    small = ctl.spawn(snap, 1, memory_limit_mib=256)[0]["id"]
    assert tmpfs_mib(ctl, small, "/tmp") == 128 and tmpfs_mib(ctl, small, "/dev/shm") == 64
    default = ctl.spawn(snap, 1)[0]["id"]
    assert tmpfs_mib(ctl, default, "/tmp") == 1024 and tmpfs_mib(ctl, default, "/dev/shm") == 512
    full = sh(ctl, small, "dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>&1; echo rc=$?")["stdout"]
    assert "No space left on device" in full and "rc=1" in full
    assert ctl.ping(small)["pong"] is True
    # a copy is never short of room: a branch of it holds what it held, in a larger /tmp if needed
    ctl.branch(small, "tmp-full")
    kid = ctl.spawn("tmp-full", 1, memory_limit_mib=128)[0]["id"]
    assert sh(ctl, kid, "stat -c %s /tmp/fill")["stdout"].strip() == str(sh(ctl, small, "stat -c %s /tmp/fill")["stdout"].strip())
    assert tmpfs_mib(ctl, kid, "/tmp") >= 128


def test_each_server_has_its_own_cgroup_subtree(ctl, snap, short_dir):
    """Two servers on one host: their leaves live apart, and one's start-up sweep (which removes
    empty leaves) never touches the other's, e.g. a leaf made a moment before its pid is written."""
    from forkd_engine.process import ProcessEngine

    sb = ctl.spawn(snap, 1)[0]["id"]
    leaf = sb_cgroups(ctl, sb)[0]
    ours = ctl.engines["process"].cgroups.group
    assert f"/{ours}/{sb}" in leaf and ours.startswith("forkd/")
    just_made = os.path.join(os.path.dirname(leaf), "sb-being-made")
    os.mkdir(just_made)
    try:
        other = ProcessEngine(os.path.join(short_dir, "other"))   # a second server starts: it sweeps
        assert other.cgroups.group != ours
        assert os.path.isdir(just_made)
    finally:
        os.rmdir(just_made)


def test_the_hint_never_suggests_a_limit_this_host_would_refuse():
    """Twice the limit while that fits, then "host" (all of this host's memory); a sandbox whose
    limit was all of it already is told to free memory or use a bigger host, with no way to raise."""
    from forkd_server.controller.checks import host_memory_mib
    from forkd_server.controller.endings import raise_hint, ways_to_raise
    host = host_memory_mib()
    assert raise_hint("t", 64).endswith("a larger memory_limit_mib, e.g. 128")
    near = ways_to_raise("t", host - 16)
    assert near["cli"] == "forkd spawn --tag t --memory-limit-mib host"
    assert near["rest"] == 'POST /v1/sandboxes {"snapshot_tag": "t", "memory_limit_mib": "host"}'
    assert near["sdk"] == "spawn_sandboxes('t', memory_limit_mib='host')"
    assert raise_hint("t", host) == (f"its limit was all of this host's memory ({host} MiB): to go on, free memory "
                                     f"on this host (end sandboxes, delete snapshots) or run t on a host with more")
    assert ways_to_raise("t", host) == {}
