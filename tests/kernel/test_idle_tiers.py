"""The forkd kernel moves an idle notebook's sandbox down the tiers: on the process engine, frozen
after ``$FORKD_KERNEL_FREEZE_AFTER`` seconds (frozen is the deepest tier there); the next cell
wakes it, its state intact, and says in one line how long the wake took."""

from __future__ import annotations

import os
import time

import pytest
from jupyter_client.manager import start_new_kernel

from forkd_server.client import Controller

from .cells import head_of, run


@pytest.fixture
def idle_kernel(forkd_server):
    km, kc = start_new_kernel(kernel_name="forkd-python", startup_timeout=120,
                              env={**os.environ, "FORKD_KERNEL_FREEZE_AFTER": "1", "FORKD_KERNEL_STORE_AFTER": "2"})
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=False)


def wait_tier(ctl: Controller, sandbox: str, tier: str, timeout: float = 60) -> str:
    """Bounded polling of the server until ``sandbox`` is in ``tier``; returns the tier last seen."""
    deadline = time.monotonic() + timeout
    while (seen := ctl.get_sandbox(sandbox)["tier"]) != tier and time.monotonic() < deadline:
        time.sleep(0.1)
    return seen


def test_an_idle_notebook_is_frozen_and_the_next_cell_wakes_it(forkd_server, idle_kernel):
    _, kc = idle_kernel
    assert run(kc, "x = 21").ok
    head = head_of(kc)
    ctl = Controller(forkd_server.url, forkd_server.token)
    assert wait_tier(ctl, head, "frozen") == "frozen"
    shown = run(kc, "%forkd head").result
    assert "frozen" in shown  # %forkd head runs in the kernel: it does not wake HEAD
    cell = run(kc, "x * 2")
    assert cell.result == "42"
    woke = [c["text"] for c in cell.of("stream") if "woke" in c["text"]]
    assert len(woke) == 1 and f"woke this notebook's sandbox {head} from frozen in " in woke[0]
    assert ctl.get_sandbox(head)["tier"] == "running"
    # past store_after too, the process engine keeps it frozen: a process cannot be written as files
    assert wait_tier(ctl, head, "frozen") == "frozen"
    deadline = time.monotonic() + 3  # store_after (2 s) passes: it stays frozen throughout
    while time.monotonic() < deadline:
        assert ctl.get_sandbox(head)["tier"] == "frozen"
        time.sleep(0.1)
    assert run(kc, "x").result == "21"
