"""Snapshot → children → branch → grandchildren on real process sandboxes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from forkd_server.errors import ForkdError

from .conftest import ev, sh

from ..conftest import requires_root

pytestmark = requires_root


def test_state_carried_parent_child_grandchild(ctl, snap):
    child = ctl.spawn(snap, 1)[0]["id"]
    expected_sha = ev(ctl, child, "blob_sha")
    assert ev(ctl, child, "hashlib.sha256(blob.tobytes()).hexdigest() == blob_sha") == "True"
    ctl.run_code(child, "counter += 1\nnote = 'from child'")
    branch = ctl.branch(child)
    assert branch["status"] == "ready" and branch["branched_from"] == child
    assert branch["lineage"] == ["base", child, branch["tag"]]
    grand = ctl.spawn(branch["tag"], 2)
    for g in grand:
        assert ev(ctl, g["id"], "counter") == "42"
        assert ev(ctl, g["id"], "note") == "'from child'"
        assert ev(ctl, g["id"], "blob_sha") == expected_sha
        assert ev(ctl, g["id"], "hashlib.sha256(blob.tobytes()).hexdigest()") == expected_sha
        assert g["lineage"] == ["base", child, branch["tag"], g["id"]]
    # and one level deeper: a grandchild's branch forks great-grandchildren
    ctl.run_code(grand[0]["id"], "counter += 100")
    deeper = ctl.branch(grand[0]["id"])
    great = ctl.spawn(deeper["tag"], 1)[0]["id"]
    assert ev(ctl, great, "counter") == "142"
    assert ev(ctl, grand[1]["id"], "counter") == "42"


def test_memory_isolation_between_siblings_and_source(ctl, snap):
    a, b = (s["id"] for s in ctl.spawn(snap, 2))
    ctl.run_code(a, "counter = -1\nblob[:1000] = 0")
    assert ev(ctl, a, "counter") == "-1"
    assert ev(ctl, b, "counter") == "41"
    assert ev(ctl, b, "hashlib.sha256(blob.tobytes()).hexdigest() == blob_sha") == "True"
    # the snapshot itself is untouched: a new child still sees the original
    c = ctl.spawn(snap, 1)[0]["id"]
    assert ev(ctl, c, "counter") == "41"


def test_file_isolation_between_siblings_source_and_branches(ctl, snap):
    a, b = (s["id"] for s in ctl.spawn(snap, 2))
    for sb in (a, b):
        assert sh(ctl, sb, "cat /tmp/from-setup.txt")["stdout"] == "setup"
    assert sh(ctl, a, "echo child-a > /tmp/from-setup.txt && echo new > /tmp/only-a")["exit_code"] == 0
    assert sh(ctl, b, "cat /tmp/from-setup.txt")["stdout"] == "setup"
    assert sh(ctl, b, "test -e /tmp/only-a")["exit_code"] == 1
    branch = ctl.branch(a)
    sh(ctl, a, "echo after-branch > /tmp/only-a")
    g = ctl.spawn(branch["tag"], 1)[0]["id"]
    assert sh(ctl, g, "cat /tmp/only-a")["stdout"] == "new\n"   # the branch froze a's files
    sh(ctl, g, "echo grandchild > /tmp/only-a")
    assert sh(ctl, a, "cat /tmp/only-a")["stdout"] == "after-branch\n"
    c = ctl.spawn(snap, 1)[0]["id"]
    assert sh(ctl, c, "cat /tmp/from-setup.txt; test -e /tmp/only-a || echo absent")["stdout"] == "setupabsent\n"


def test_the_rest_of_the_filesystem_is_read_only_and_host_state_invisible(ctl, snap):
    sb = ctl.spawn(snap, 1)[0]
    out = sh(ctl, sb["id"], "touch /usr/x 2>&1; touch /etc/x 2>&1; ls /root; echo; id -u")
    assert "Read-only file system" in out["stdout"]
    assert out["stdout"].strip().endswith("0")  # root inside its own user namespace...
    with open(f"/proc/{sb['pid']}/status") as f:  # ...an unprivileged uid on the host
        uid_line = next(line for line in f if line.startswith("Uid:"))
    assert uid_line.split()[1] == "65534"
    # the server's data dir (registry, sockets) does not exist inside
    assert sh(ctl, sb["id"], f"ls {ctl.data_dir} 2>&1 || echo hidden")["stdout"].strip().endswith("hidden")
    assert ev(ctl, sb["id"], f"__import__('os').path.exists({ctl.data_dir + '/registry.sqlite3'!r})") == "False"


def test_network_isolation_loopback_only(ctl, snap):
    a, b = (s["id"] for s in ctl.spawn(snap, 2))
    serve = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 8765)); s.listen(); srv = s"
    ctl.run_code(a, serve)
    ctl.run_code(b, serve)  # the same port is free in a sibling: its own network namespace
    probe = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 8765), timeout=2).close(); r = 'open'\n"
             "except OSError as e:\n    r = type(e).__name__\nr")
    assert ctl.run_code(a, probe)["result"]["text/plain"] == "'open'"
    c = ctl.spawn(snap, 1)[0]["id"]
    assert ctl.run_code(c, probe)["result"]["text/plain"] == "'ConnectionRefusedError'"
    links = sh(ctl, a, "ls /sys/class/net 2>/dev/null; cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    assert links["stdout"].split()[-1] == "lo" and "eth0" not in links["stdout"].split()[-1:]
    ifaces = ev(ctl, a, "__import__('socket').if_nameindex()")
    assert ifaces == "[(1, 'lo')]"


def test_pid_isolation(ctl, snap):
    a, b = ctl.spawn(snap, 2)
    assert ctl.ping(a["id"])["pid"] == 2  # PID 1 is its init (forkd-init)
    sh(ctl, a["id"], "sleep 30 > /dev/null 2>&1 &")
    pids_b = sh(ctl, b["id"], "ls /proc | grep -E '^[0-9]+$'")["stdout"].split()
    assert {"1", "2"} <= set(pids_b) and len(pids_b) <= 5  # init, agent, sh, ls, grep: nothing of the sibling
    assert "sleep" not in sh(ctl, b["id"], "cat /proc/[0-9]*/comm")["stdout"]
    assert "sleep" in sh(ctl, a["id"], "cat /proc/[0-9]*/comm")["stdout"]
    assert a["pid"] != b["pid"]


def test_children_draw_different_random_numbers(ctl, snap):
    kids = [s["id"] for s in ctl.spawn(snap, 3)]
    for expr in ("random.random()", "numpy.random.random()", "os.urandom(8).hex()",
                 "__import__('uuid').uuid4().hex"):
        if expr.startswith("os."):
            expr = "__import__('os').urandom(8).hex()"
        values = {ev(ctl, k, expr) for k in kids}
        assert len(values) == 3, (expr, values)
    # a generator the user seeded on purpose keeps its stream
    seeded = {ev(ctl, k, "numpy.random.default_rng(7).integers(0, 10**9)") for k in kids}
    assert len(seeded) == 1


def test_a_branch_imports_nothing_its_source_did_not_and_its_children_draw_their_own(ctl):
    ctl.create_snapshot("bare-numpy", setup="import os")
    source = ctl.spawn("bare-numpy", 1)[0]["id"]
    ev(ctl, source, "__import__('numpy').ones(3).sum()")  # numpy without numpy.random (numpy 2)
    loaded = "'numpy.random' in __import__('sys').modules"
    if ev(ctl, source, loaded) == "True":
        pytest.skip("this numpy imports numpy.random with numpy")
    ctl.branch(source, "bare-numpy-branch", mode="live")
    kids = [s["id"] for s in ctl.spawn("bare-numpy-branch", 2)]
    for sb in [source, *kids]:
        assert ev(ctl, sb, loaded) == "False", sb
    draws = {ev(ctl, sb, "__import__('numpy').random.random()") for sb in [source, *kids]}
    assert len(draws) == 3, draws
    for sb in [source, *kids]:
        ctl.kill_sandbox(sb)
    ctl.delete_snapshot("bare-numpy-branch")
    ctl.delete_snapshot("bare-numpy")


def test_branching_a_busy_source_is_refused_unless_lossy_and_leaves_it_running(ctl, snap):
    source = ctl.spawn(snap, 1)[0]["id"]
    # The cell computes until the test releases it (a file in its /tmp), so it cannot end before
    # the branches below however loaded the machine is; its deadline only keeps a failed test from
    # leaving it running for ever. total == i*(i-1)/2 shows the branches did not disturb it.
    loop = ("import os, time\nopen('/tmp/started', 'w').close()\n"
            "total = i = 0\ndeadline = time.time() + 300\n"
            "while not os.path.exists('/tmp/release') and time.time() < deadline:\n"
            "    total += i\n    i += 1\n"
            "(os.path.exists('/tmp/release'), i > 0 and total == i * (i - 1) // 2)")
    busy: dict = {}
    worker = threading.Thread(target=lambda: busy.update(ctl.run_code(source, loop)), daemon=True)
    worker.start()
    try:
        while worker.is_alive() and "started" not in {e["name"] for e in ctl.files(source, "list", "/tmp")["entries"]}:
            pass
        assert worker.is_alive(), busy
        # The cell would not go on running in the branch: refused, saying so and how to go on.
        with pytest.raises(ForkdError) as refused:
            ctl.branch(source, "busy-branch")
        assert refused.value.status == 409
        assert "a cell has been running" in refused.value.message and "lossy fork" in refused.value.hint
        assert refused.value.details["rest"] == '"lossy": true'
        branch = ctl.branch(source, "busy-branch", lossy=True)
        assert worker.is_alive()  # the branch returned while the source was still computing
        assert any("a cell has been running" in w for w in branch["warnings"])
    finally:
        assert sh(ctl, source, "touch /tmp/release")["exit_code"] == 0
        worker.join(60)
    assert busy["exit_code"] == 0, busy
    assert busy["result"]["text/plain"] == "(True, True)"  # released by the test, and computed right
    assert ctl.ping(source)["pong"] is True
    # the branch is a usable snapshot: its children serve requests
    g = ctl.spawn(branch["tag"], 1)[0]["id"]
    assert ev(ctl, g, "counter") == "41"


def test_branch_outlives_its_source_and_children_outlive_their_snapshot(ctl, snap):
    tmp_snap = ctl.create_snapshot("short-lived", setup="value = 'kept'")["tag"]
    child = ctl.spawn(tmp_snap, 1)[0]["id"]
    branch = ctl.branch(child)["tag"]
    ctl.delete_snapshot(tmp_snap)                 # never kills running children
    assert ev(ctl, child, "value") == "'kept'"
    ctl.kill_sandbox(child)                       # the branch survives its source
    assert ctl.get_snapshot(branch)["status"] == "ready"
    g = ctl.spawn(branch, 1)[0]["id"]
    assert ev(ctl, g, "value") == "'kept'"
    assert child not in {s["id"] for s in ctl.list_sandboxes()}


def test_async_live_branch_goes_writing_then_ready(ctl, snap):
    child = ctl.spawn(snap, 1)[0]["id"]
    events = []
    unsubscribe = ctl.subscribe(events.append)
    try:
        info = ctl.branch(child, "async-live", mode="live", wait=False)
        assert info["status"] in ("writing", "ready") and info["pause_ms"] >= 0
        assert ctl.wait_snapshot("async-live", timeout=30)["status"] == "ready"
    finally:
        unsubscribe()
    statuses = [e["status"] for e in events if e.get("tag") == "async-live"]
    assert statuses[0] == "writing" and statuses[-1] == "ready"


def test_default_branch_tags_are_per_source_monotonic(ctl, snap):
    child = ctl.spawn(snap, 1)[0]["id"]
    tags = [ctl.branch(child, mode=m)["tag"] for m in ("full", "diff", "live")]
    assert tags == [f"branch-{child}-0", f"branch-{child}-1", f"branch-{child}-2"]
    info = ctl.get_sandbox(child)
    assert info["branch_count"] == 3 and info["has_branched"] is True


def test_deep_lineage_until_the_kernel_limit_gives_a_clear_error(short_dir):
    """Every generation nests a pid namespace; the kernel allows 32 levels: 15 branch generations.
    Past that the request cannot be served as asked: a 409 that says why and what to do, not a 500."""
    from forkd_server.controller import Controller
    from forkd_server.errors import Conflict

    from .conftest import cleanup

    c = Controller(short_dir)
    try:
        c.create_snapshot("deep", setup="depth = 0")
        sb = c.spawn("deep", 1)[0]["id"]
        generations = 0
        with pytest.raises(Conflict, match="lineage too deep.*VM engine") as refused:
            while True:
                c.run_code(sb, "depth += 1")
                tag = c.branch(sb)["tag"]
                sb = c.spawn(tag, 1)[0]["id"]
                generations += 1
        assert generations >= 14
        assert refused.value.status == 409
        assert ev(c, sb, "depth") == str(generations + 1)  # incremented before the refused branch
    finally:
        cleanup(c)
        c.close()


def test_listing_follows_branches_kills_and_deaths(ctl, snap):
    a, b = (s["id"] for s in ctl.spawn(snap, 2))
    before = {s["id"]: s for s in ctl.list_sandboxes()}
    assert before[a]["branch_count"] == 0 and not before[a]["has_branched"]
    ctl.branch(a)
    after = {s["id"]: s for s in ctl.list_sandboxes()}
    assert after[a]["branch_count"] == 1 and after[a]["has_branched"]
    after[a]["branch_count"] = 99                 # a caller's copy, not the cache
    assert {s["id"]: s for s in ctl.list_sandboxes()}[a]["branch_count"] == 1
    os.kill(after[b]["pid"], signal.SIGKILL)      # dies outside forkd: the registry does not know yet
    deadline = time.monotonic() + 10
    while b in {s["id"] for s in ctl.list_sandboxes()}:
        assert time.monotonic() < deadline, "a dead sandbox stayed listed"
        time.sleep(0.02)
    ctl.kill_sandbox(a)
    assert a not in {s["id"] for s in ctl.list_sandboxes()}
