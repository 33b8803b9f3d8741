"""Bad input raises the error class (and HTTP status) forkd's API documents, before any work."""

from __future__ import annotations

import os
import shutil

import pytest

from forkd_server.errors import BadRequest, Busy, Conflict, NotFound

from ..conftest import requires_root

pytestmark = requires_root


@pytest.mark.parametrize("tag", ["", "-lead", ".dot", "a/b", "..", "../etc", "x" * 65, "sp ace", "é", "a\nb", 7, None])
def test_bad_tags_are_400(ctl, tag):
    with pytest.raises(BadRequest):
        ctl.create_snapshot(tag)
    with pytest.raises(BadRequest):
        ctl.spawn(tag, 1)


@pytest.mark.parametrize("tag", ["a", "_x", "A.b-c_9", "x" * 64, "v1.2.3"])
def test_good_tags_pass_the_rule(tag):
    from forkd_server.controller.checks import check_tag
    assert check_tag(tag) == tag


@pytest.mark.parametrize("n, status", [(0, 400), (1001, 400), (-1, 400), ("3", 400), (True, 400), (2.5, 400)])
def test_bad_n(ctl, snap, n, status):
    with pytest.raises(BadRequest) as info:
        ctl.spawn(snap, n)
    assert info.value.status == status


def test_check_order_n_before_tag(ctl):
    # forkd checks n first: n=0 with an unsafe tag is about n
    with pytest.raises(BadRequest, match="n must"):
        ctl.spawn("../x", 0)


def test_unknown_ids_are_404(ctl, snap):
    for call in (lambda: ctl.get_sandbox("sb-nope"), lambda: ctl.kill_sandbox("sb-nope"),
                 lambda: ctl.ping("sb-nope"), lambda: ctl.exec("sb-nope", ["true"]),
                 lambda: ctl.eval("sb-nope", "1"), lambda: ctl.run_code("sb-nope", "1"),
                 lambda: ctl.files("sb-nope", "list", "/"), lambda: ctl.spawn("no-such-snap", 1),
                 lambda: ctl.get_snapshot("no-such-snap"), lambda: ctl.delete_snapshot("no-such-snap"),
                 lambda: ctl.branch("sb-nope", "t-404")):
        with pytest.raises(NotFound) as info:
            call()
        assert info.value.status == 404
        assert "not found" in info.value.message


def test_exec_checks_unknown_sandbox_before_empty_args(ctl, snap):
    with pytest.raises(NotFound):
        ctl.exec("sb-nope", [])
    sb = ctl.spawn(snap, 1)[0]["id"]
    with pytest.raises(BadRequest):
        ctl.exec(sb, [])


def test_snapshot_exists_is_400_like_forkd(ctl, snap):
    with pytest.raises(BadRequest, match="already exists"):
        ctl.create_snapshot(snap)


def test_bad_snapshot_specs(ctl):
    with pytest.raises(BadRequest):
        ctl.create_snapshot("e1", engine="docker")
    with pytest.raises(BadRequest):
        ctl.create_snapshot("e2", setup_commands=["ls"])
    with pytest.raises(BadRequest):
        ctl.create_snapshot("e3", setup=42)


@pytest.mark.parametrize("packages, match", [
    (["Python3-NumPy"], "not a Debian package name"),
    (["python3-numpy; rm -rf /"], "not a Debian package name"),
    (["-o"], "not a Debian package name"),
    ([42], "not a Debian package name"),
    (["p%d" % i for i in range(65)], "at most 64"),
    (["a" * 101], "not a Debian package name"),
    (["python3-numpy"], "packages need engine vm"),
])
def test_packages_are_checked_before_anything_runs(ctl, packages, match):
    with pytest.raises(BadRequest, match=match):
        ctl.create_snapshot("pk", engine="process", packages=packages)
    assert ctl.registry.get_snapshot("pk") is None


def test_failing_setup_is_reported_and_not_registered(ctl):
    # the request's own setup failed: a 400 that says how, not an engine failure
    with pytest.raises(BadRequest) as code:
        ctl.create_snapshot("broken", setup="1/0")
    assert code.value.message == ("snapshot broken: your setup code raised ZeroDivisionError: division by zero "
                                  "(setup line 1)\nnothing was created: fix the setup and create the snapshot again")
    assert "setup line 1, in <module>" in code.value.details["traceback"]
    with pytest.raises(BadRequest, match="exited 3") as command:
        ctl.create_snapshot("broken-cmd", setup_commands=[["sh", "-c", "echo oops >&2; exit 3"]])
    assert command.value.details["output"] == "oops"
    assert {"broken", "broken-cmd"}.isdisjoint(s["tag"] for s in ctl.list_snapshots())


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64")
def test_a_vm_shell_its_packages_lack_is_a_400(short_dir):
    """shell ipython on a VM whose packages hold no IPython: the request's own, as a failing setup
    (schemathesis found it a 500)."""
    from forkd_engine.vm import VMEngine

    from forkd_server.controller import Controller

    engine = VMEngine(os.path.join(short_dir, "vm"),
                      cache_dir=os.environ.get("FORKD_VM_CACHE") or os.path.join(short_dir, "cache"))
    vm = Controller(short_dir, engines={"vm": engine})
    try:
        with pytest.raises(BadRequest, match="IPython could not start in the guest.*python3-ipython"):
            vm.create_snapshot("noipy", engine="vm", shell="ipython", setup="x = 1")
        assert vm.registry.get_snapshot("noipy") is None
    finally:
        vm.close()


def test_branch_mode_validation_in_forkd_order(ctl, snap):
    sb = ctl.spawn(snap, 1)[0]["id"]
    with pytest.raises(BadRequest):
        ctl.branch(sb, "m1", mode="full", diff=True)
    with pytest.raises(BadRequest):
        ctl.branch(sb, "m2", mode="fast")
    with pytest.raises(BadRequest):
        ctl.branch(sb, "m3", diff=True, live=True)
    with pytest.raises(BadRequest):
        ctl.branch(sb, "m4", wait=False)                     # no-wait needs live
    with pytest.raises(BadRequest):
        ctl.branch(sb, "m5", parent_tag="other", diff=True)
    with pytest.raises(BadRequest):
        ctl.branch(sb, "m6", parent_tag=snap)                # parent_tag needs diff
    assert ctl.branch(sb, "m7", parent_tag=snap, diff=True)["status"] == "ready"
    with pytest.raises(Conflict, match="already exists"):
        ctl.branch(sb, "m7")
    # a valid body for a missing sandbox is 404, not 400
    with pytest.raises(NotFound):
        ctl.branch("sb-nope", "m8", mode="full")
    # no slot leaked by any of the refusals above
    assert ctl.branches.slots_in_use == 0 and not ctl.branches.in_flight


def test_branch_cap_and_in_flight_conflict(short_dir):
    """With a cap of 1, a second branch while one is still writing is 503; the same tag is 409."""
    from forkd_server.controller import Controller
    c = Controller(short_dir, branch_concurrency=1)
    try:
        c.create_snapshot("cap", setup="x = 1")
        a, b = (s["id"] for s in c.spawn("cap", 2))
        # 400 MiB in /tmp: the new snapshot copies it, so it stays `writing` for a while
        c.exec(a, ["sh", "-c", "head -c 400M /dev/zero > /tmp/big"])
        first = c.branch(a, "slow", mode="live", wait=False)
        assert first["status"] == "writing"
        with pytest.raises(Conflict, match="in flight"):
            c.branch(b, "slow", mode="live", wait=False)
        with pytest.raises(Busy) as info:
            c.branch(b, "other", mode="live", wait=False)
        assert info.value.status == 503
        assert c.wait_snapshot("slow", timeout=60)["status"] == "ready"
        assert c.branch(b, "other")["status"] == "ready"  # the slot came back
    finally:
        from .conftest import cleanup
        cleanup(c)
        c.close()


# Every number of snapshot create and spawn has a bound, and a value past it is a 400 that states
# the bound, answered at once (never a hang, never a 500): (call, field, value, what the 400 says).
HOST = "at most this host's memory"
BOUNDS = [
    ("create", "mem_size_mib", 2**63, HOST), ("create", "mem_size_mib", 1 << 20, HOST),  # 2^63, 1 TiB
    ("create", "mem_size_mib", 128, "between 192 and"), ("create", "mem_size_mib", "256", "must be an integer"),
    ("create", "memory_limit_mib", 2**63, HOST), ("create", "memory_limit_mib", 1 << 20, HOST),
    ("create", "memory_limit_mib", 15, "between 16 and"), ("create", "memory_limit_mib", 1.5, "must be an integer"),
    ("create", "disk_mib", 2**63, "at most 1 TiB and the free space"), ("create", "disk_mib", 8, "between 16 and"),
    ("create", "setup_timeout_secs", 0, "between 1 and 86400"), ("create", "setup_timeout_secs", 86401, "between 1 and 86400"),
    ("create", "setup_timeout_secs", -5, "between 1 and 86400"), ("create", "setup_timeout_secs", float("nan"), "a number of seconds"),
    ("create", "setup_timeout_secs", float("inf"), "a number of seconds"), ("create", "setup_timeout_secs", True, "a number of seconds"),
    ("spawn", "memory_limit_mib", 2**63, HOST), ("spawn", "memory_limit_mib", 1 << 20, HOST),
    ("spawn", "memory_limit_mib", 15, "between 16 and"), ("spawn", "memory_limit_mib", "64", 'a number of MiB or "host"'),
    ("spawn", "n", 2**63, "between 1 and 1000"), ("spawn", "n", 1001, "between 1 and 1000"),
]


@pytest.mark.parametrize("call, field, value, says", BOUNDS, ids=[f"{c}-{f}-{v!r:.12}" for c, f, v, _ in BOUNDS])
def test_every_number_is_bounded_with_a_400_that_states_the_bound(ctl, snap, call, field, value, says):
    before = {s["id"] for s in ctl.list_sandboxes()}
    with pytest.raises(BadRequest) as info:
        if call == "create":
            ctl.create_snapshot("bounded", engine="process", **{field: value})
        elif field == "n":
            ctl.spawn(snap, value)
        else:
            ctl.spawn(snap, 1, **{field: value})
    assert info.value.status == 400 and field in info.value.message and says in info.value.message, info.value.message
    assert {s["id"] for s in ctl.list_sandboxes()} == before  # refused before anything started
    assert "bounded" not in {s["tag"] for s in ctl.list_snapshots()}
