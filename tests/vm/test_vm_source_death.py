"""A VM sandbox's branches are save points: however the sandbox dies (its QEMU killed with SIGKILL,
its guest kernel panicking), both of its branches still spawn children holding its state, the
grandchild already running from one of them still answers, and the sandbox's 404/410 says how it
ended."""

from __future__ import annotations

import os

import pytest
from forkd_engine import linux

from forkd_server.errors import Gone, NotFound

from .conftest import requires_qemu, vm_controller

pytestmark = requires_qemu


@pytest.fixture(scope="module")
def ctl(vm_engine):
    with vm_controller(vm_engine, "deathbase", "import os\nvalue = 7") as c:
        yield c


def source_with_save_points(ctl, case: str) -> tuple[str, list[str], str]:
    """A sandbox holding ``saved``, branched twice (full, diff), with a grandchild running from the
    first branch: (sandbox id, branch tags, grandchild id)."""
    (src,) = ctl.spawn("deathbase", 1)
    reply = ctl.run_code(src["id"], f"saved = 'kept-{case}'")
    assert reply["exit_code"] == 0, reply
    tags = [ctl.branch(src["id"], f"{case}-{mode}", mode=mode)["tag"] for mode in ("full", "diff")]
    (grandchild,) = ctl.spawn(tags[0], 1)
    return src["id"], tags, grandchild["id"]


def assert_save_points_hold(ctl, case: str, tags: list[str], grandchild: str) -> None:
    assert ctl.eval(grandchild, "saved")["result"] == repr(f"kept-{case}")
    for tag in tags:
        assert ctl.get_snapshot(tag)["status"] == "ready"
        (kid,) = ctl.spawn(tag, 1)
        assert ctl.eval(kid["id"], "(saved, value)")["result"] == repr((f"kept-{case}", 7))


def test_sigkill_of_the_sources_qemu_leaves_its_branches_usable(ctl):
    source, tags, grandchild = source_with_save_points(ctl, "sigkill")
    sandbox = ctl.get_sandbox(source)
    os.kill(sandbox["pid"], 9)
    assert linux.wait_exit(sandbox["pid"], ctl.registry.get_sandbox(source)["handle"]["start_time"], 30)
    with pytest.raises(NotFound) as info:
        ctl.ping(source)
    assert "ended unexpectedly" in info.value.message and "killed outside forkd" in info.value.message
    assert_save_points_hold(ctl, "sigkill", tags, grandchild)


def test_a_guest_kernel_panic_leaves_its_branches_usable(ctl):
    source, tags, grandchild = source_with_save_points(ctl, "panic")
    with pytest.raises(Gone) as info:  # the call it died during
        ctl.exec(source, ["sh", "-c", "echo c > /proc/sysrq-trigger"], timeout_secs=60)
    assert "guest kernel panicked" in info.value.message and "sysrq triggered crash" in info.value.message
    with pytest.raises(NotFound) as info:  # and any later one
        ctl.ping(source)
    assert "guest kernel panicked" in info.value.message
    assert_save_points_hold(ctl, "panic", tags, grandchild)
