"""Tiers by hand on the process engine, through ``forkd serve`` and the SDK: a frozen sandbox takes
no CPU and the next call wakes it with its state; ``/store`` is a 409 saying why (a process cannot
be written as files) and what to use; a restart keeps a frozen sandbox frozen and wakeable."""

from __future__ import annotations

import threading
import time

import pytest

from forkd_server.client import ControllerError, Sandbox

SPIN = """
import threading
spins = 0
def spin():
    global spins
    while True:
        spins += 1
threading.Thread(target=spin, daemon=True).start()
"""


@pytest.fixture(scope="module")
def snap(ctl):
    ctl.create_snapshot("tier-base", setup="x = 41")
    yield "tier-base"
    ctl.delete_snapshot("tier-base")


@pytest.fixture
def sandbox(ctl, snap):
    sb = Sandbox.create(snap, controller=ctl)
    yield sb
    try:
        sb.kill()
    except ControllerError:
        pass


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def ticks_grow(pid: int, timeout: float = 30) -> bool:
    """True once the process has used CPU (a spinning thread does, however loaded the host)."""
    start, deadline = cpu_ticks(pid), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cpu_ticks(pid) > start:
            return True
        time.sleep(0.05)
    return False


def test_a_frozen_sandbox_uses_no_cpu_and_the_next_eval_wakes_it_with_its_state(ctl, sandbox):
    sandbox.run_code(SPIN)
    pid = sandbox.info["pid"]
    assert ticks_grow(pid)  # spinning: it uses CPU while it runs
    assert sandbox.freeze().tier == "frozen"
    assert ctl.get_sandbox(sandbox.id)["tier"] == "frozen"
    assert [s["tier"] for s in ctl.list_sandboxes() if s["id"] == sandbox.id] == ["frozen"]
    before = cpu_ticks(pid)
    assert not ticks_grow(pid, timeout=1.5)  # the same spinning thread, frozen: not one tick
    assert cpu_ticks(pid) == before
    assert sandbox.eval("x + 1") == "42"  # woken by the call, its state intact
    assert sandbox.refresh().tier == "running"
    assert ticks_grow(pid)  # and it runs on: the thread spins again


def test_wake_says_how_long_and_freezing_twice_is_no_error(sandbox):
    sandbox.freeze()
    assert sandbox.freeze().tier == "frozen"
    woke = sandbox.wake()
    assert woke["from"] == "frozen" and woke["ms"] >= 0 and sandbox.tier == "running"
    assert sandbox.wake()["from"] == "running"


def test_store_on_the_process_engine_is_a_409_saying_why_and_what_to_use(sandbox):
    with pytest.raises(ControllerError) as err:
        sandbox.store()
    assert err.value.status == 409
    assert "a process cannot be written as files" in err.value.what
    assert "freeze" in err.value.hint and "vm engine" in err.value.hint
    assert sandbox.refresh().tier == "running" and sandbox.eval("x") == "41"


def test_a_move_down_while_a_call_runs_is_a_409_and_the_call_finishes(ctl, sandbox):
    done = {}
    # the cell runs until the test lets it end: however slow the host, the freeze finds it running
    code = "import os, time\nwhile not os.path.exists('/tmp/go'):\n    time.sleep(0.01)\nx"
    cell = threading.Thread(target=lambda: done.update(out=sandbox.run_code(code)))
    cell.start()
    deadline = time.monotonic() + 30
    while not ctl.ping_sandbox(sandbox.id).get("busy"):
        assert time.monotonic() < deadline, "the cell did not start within 30 s"
        time.sleep(0.02)
    try:
        with pytest.raises(ControllerError) as err:
            sandbox.freeze()
    finally:
        sandbox.files.write("/tmp/go", "")
    assert err.value.status == 409 and "is running" in err.value.what
    cell.join(60)
    assert done["out"].error is None and done["out"].text == "41"
    assert sandbox.refresh().tier == "running"


def test_a_freeze_waits_for_a_short_call_under_way_and_then_freezes(ctl, sandbox):
    """A call that returns within a moment (a panel's ping, a quick eval) does not make a freeze a
    409: the freeze waits for it, then freezes; the call's answer is whole."""
    done = {}
    call = threading.Thread(target=lambda: done.update(out=sandbox.eval("__import__('time').sleep(0.5) or x")))
    call.start()
    deadline = time.monotonic() + 30
    while not ctl.ping_sandbox(sandbox.id).get("busy"):
        assert time.monotonic() < deadline, "the eval did not start within 30 s"
        time.sleep(0.02)
    assert sandbox.freeze().tier == "frozen"
    call.join(60)
    assert done["out"] == "41"
    assert ctl.get_sandbox(sandbox.id)["tier"] == "frozen"


def test_a_restart_keeps_a_frozen_sandbox_frozen_and_wakeable(server, ctl, sandbox):
    sandbox.run_code("y = 'kept'")
    sandbox.freeze()
    server.crash_and_restart()
    assert sandbox.refresh().tier == "frozen"
    assert sandbox.eval("y") == "'kept'"
    assert sandbox.refresh().tier == "running"


async def test_the_async_sdk_moves_tiers_too(server, snap):
    from forkd_server.client import AsyncController, AsyncSandbox

    async with AsyncController(server.url, server.token) as actl:
        async with await AsyncSandbox.create(snap, controller=actl) as sb:
            assert (await sb.freeze()).tier == "frozen"
            woke = await sb.wake()
            assert woke["from"] == "frozen" and sb.tier == "running"
            assert await sb.eval("x") == "41"


def test_the_cli_moves_tiers_and_says_why_it_cannot_store(server, sandbox):
    from .test_serve import cli

    assert cli(server, "freeze", sandbox.id).stdout.strip() == f"{sandbox.id}: frozen"
    assert "frozen" in cli(server, "ls").stdout
    woke = cli(server, "wake", sandbox.id).stdout
    assert woke.startswith(f"{sandbox.id}: running (woken from frozen in ")
    refused = cli(server, "store", sandbox.id, check=False)
    assert refused.returncode != 0 and "a process cannot be written as files" in refused.stderr
