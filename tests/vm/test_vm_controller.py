"""The VM engine behind the controller: engine selection, 4xx for impossible modes, and a QEMU
killed with SIGKILL in the middle of a branch leaving no snapshot marked ready."""

from __future__ import annotations

import os

import pytest

from forkd_server.errors import BadRequest

from .conftest import requires_qemu, vm_controller

pytestmark = requires_qemu


@pytest.fixture(scope="module")
def ctl(vm_engine):
    with vm_controller(vm_engine, "vmbase", "import os, time\nvalue = 7") as c:
        yield c


def test_auto_is_not_vm_under_tcg(vm_engine):
    assert vm_engine.preferred is (vm_engine.accel == "kvm")


def test_controller_spawn_eval_branch_all_modes(ctl):
    (sb,) = ctl.spawn("vmbase", 1)
    assert ctl.eval(sb["id"], "value")["result"] == "7"
    ctl.run_code(sb["id"], "value = 8")
    for mode in ("full", "diff"):
        info = ctl.branch(sb["id"], f"c-{mode}", mode=mode)
        assert info["status"] == "ready" and info["pause_ms"] > 0 and info["engine"] == "vm"
    info = ctl.branch(sb["id"], "c-live", mode="live", wait=False)
    assert info["status"] == "writing" and info["pause_ms"] >= 0
    assert ctl.wait_snapshot("c-live", timeout=120)["status"] == "ready"
    kids = ctl.spawn("c-live", 2)
    assert [ctl.eval(k["id"], "value")["result"] for k in kids] == ["8", "8"]


def test_impossible_mode_is_a_400_naming_why(ctl, monkeypatch):
    from forkd_engine.vm import memory as vmem
    (sb,) = ctl.spawn("vmbase", 1)
    monkeypatch.setattr(vmem, "filesystem_type", lambda path: "ext4")
    with pytest.raises(BadRequest, match="tmpfs"):
        ctl.branch(sb["id"], "no-live", mode="live")
    with pytest.raises(Exception):
        ctl.get_snapshot("no-live")


def test_sigkill_of_qemu_mid_branch_leaves_nothing_ready(ctl):
    (sb,) = ctl.spawn("vmbase", 1)
    info = ctl.branch(sb["id"], "killed", mode="live", wait=False)
    assert info["status"] == "writing"
    os.kill(ctl.get_sandbox(sb["id"])["pid"], 9)
    final = ctl.wait_snapshot("killed", timeout=60)
    assert final["status"] == "failed" and not final["bootable"]
    assert "killed" not in [s["tag"] for s in ctl.list_snapshots() if s["status"] == "ready"]
    with pytest.raises(Exception):
        ctl.spawn("killed", 1)
    # the registry is consistent after a restart: the dead sandbox is dropped, the failed snapshot stays failed
    counts = ctl.reconcile()
    assert counts["sandboxes_dropped"] >= 1
    assert ctl.get_snapshot("killed")["status"] == "failed"
    assert ctl.get_snapshot("vmbase")["status"] == "ready"


def test_disk_needs_the_vm_engine(ctl):
    with pytest.raises(BadRequest, match="disk_mib must be"):
        ctl.create_snapshot("tiny-disk", engine="vm", disk_mib=1)
    with pytest.raises(BadRequest, match="not available|needs engine vm"):
        ctl.create_snapshot("proc-disk", engine="process", disk_mib=64)


@pytest.mark.parametrize("mode", ["full", "diff"])
def test_sigkill_of_qemu_inside_the_pause_leaves_nothing(ctl, vm_engine, monkeypatch, mode):
    from forkd_engine.vm import memory as vmem
    (sb,) = ctl.spawn("vmbase", 1)
    pid = ctl.get_sandbox(sb["id"])["pid"]
    real = vmem.private_runs
    calls = []

    def crash_then_scan(p, start, size):
        calls.append(p)
        if len(calls) == (2 if mode == "diff" else 1):  # diff scans once before the pause
            os.kill(p, 9)
            os.waitpid(p, 0) if p in vm_engine.qemu.children else None
        return real(p, start, size)

    monkeypatch.setattr(vmem, "private_runs", crash_then_scan)
    with pytest.raises(Exception):
        ctl.branch(sb["id"], f"crashed-{mode}", mode=mode)
    assert all(s["tag"] != f"crashed-{mode}" for s in ctl.list_snapshots())
    assert not os.path.exists(os.path.join(vm_engine.snap_dir, f"crashed-{mode}"))
    assert pid == calls[-1]


def test_memory_limit_caps_the_vm_and_an_overgrown_guest_is_killed(ctl):
    from forkd_server.errors import NotFound

    (sb,) = ctl.spawn("vmbase", 1, memory_limit_mib=96)
    leaves = ctl.registry.get_sandbox(sb["id"])["handle"]["cgroups"]
    leaf = next(p for p in leaves if "memory" in p)
    with open(os.path.join(leaf, "memory.max" if os.path.exists(os.path.join(leaf, "memory.max"))
                           else "memory.limit_in_bytes")) as f:
        assert int(f.read()) == 96 * 2**20
    with open(os.path.join(leaf, "cgroup.procs")) as f:
        assert str(sb["pid"]) in f.read().split()
    assert ctl.eval(sb["id"], "value")["result"] == "7"      # within its limit it works
    # The guest writes 160 MiB: copies of memory.bin pages charged to its QEMU, past the limit.
    with pytest.raises(Exception):
        ctl.run_code(sb["id"], "blob = bytearray(160 * 2**20)\nfor i in range(0, len(blob), 4096):\n"
                               "    blob[i] = 1\nlen(blob)", timeout=120)
    with pytest.raises(NotFound):                            # the OOM killer ended that VM only
        ctl.ping(sb["id"])
    assert not os.path.exists(leaf)                          # its cgroup went with it


def test_packages_through_the_controller(ctl):
    info = ctl.create_snapshot("vmpkgs", packages=["python3-six"],   # engine auto: packages mean vm
                               setup="import six\nflavour = six.PY3")
    assert info["status"] == "ready" and info["engine"] == "vm"
    assert ctl.registry.get_snapshot("vmpkgs")["spec"]["packages"] == ["python3-six"]
    (sb,) = ctl.spawn("vmpkgs", 1)
    assert ctl.eval(sb["id"], "(flavour, six.__file__.startswith('/usr/lib/python3/'))")["result"] == "(True, True)"
    ctl.kill_sandbox(sb["id"])
    with pytest.raises(BadRequest, match="apt-cache search"):
        ctl.create_snapshot("vmpkgs-bad", engine="vm", packages=["no-such-package-forkd"])
    assert ctl.registry.get_snapshot("vmpkgs-bad") is None


def test_an_ipython_shell_without_ipython_in_the_guest_is_a_400_saying_what_to_add(ctl):
    with pytest.raises(BadRequest, match="add the Debian package python3-ipython"):
        ctl.create_snapshot("no-ipython", engine="vm", shell="ipython", mem_size_mib=256)
    assert "no-ipython" not in {s["tag"] for s in ctl.list_snapshots()}


def test_a_vm_sandboxs_ping_eval_and_exec_from_the_event_loop_go_the_pools_way(ctl):
    """The VM engine can neither call its agent from the event loop (its channel) nor check a
    guest's liveness without waiting: the server's loop calls hand its sandboxes' pings, evals and
    execs to a pool's thread, every time (the second call of a sandbox, whose lock exists, too)."""
    import asyncio

    from forkd_server.controller.admission import Admission
    from forkd_server.loop_calls import LoopCalls

    (sb,) = ctl.spawn("vmbase", 1)
    sid = sb["id"]
    admission = Admission()
    calls = LoopCalls(admission)

    async def scenario():
        for _ in range(2):
            assert (await calls.ping(ctl, sid))["pong"] is True
            assert await calls.eval(ctl, sid, "value * 6", caller="test") == {"result": "42", "error": None,
                                                                             "exit_code": 0}
            assert await calls.exec(ctl, sid, ["echo", "hi"], caller="test") == {"stdout": "hi\n", "stderr": "",
                                                                                "exit_code": 0}

    try:
        asyncio.run(scenario())
    finally:
        admission.close()
    ways = {(s.labels["call"], s.labels["way"]): s.value for m in calls.ways.collect() for s in m.samples
            if s.name == "forkd_loop_calls_total"}
    assert ways == {(call, way): 2.0 if way == "pool" else 0.0 for call in ("ping", "eval", "exec")
                    for way in ("loop", "pool")}
    ctl.kill_sandbox(sid)
