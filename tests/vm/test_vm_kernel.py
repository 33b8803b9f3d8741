"""The forkd kernel on the VM engine: the notebook's shell is IPython inside a microVM (TCG here)."""

from __future__ import annotations

import os

import pytest
from jupyter_client.manager import start_new_kernel

from ..kernel.conftest import ServerForKernels
from ..kernel.cells import run
from .conftest import requires_qemu

pytestmark = [requires_qemu, pytest.mark.slow]

# True once the thread appending to ``ticks`` has ticked again: waits for it (bounded), so a loaded
# machine cannot make a live thread look stopped.
TICKED = ("def ticked(limit=30):\n    n, end = len(ticks), time.time() + limit\n"
          "    while len(ticks) == n and time.time() < end:\n        time.sleep(0.01)\n    return len(ticks) > n")


@pytest.fixture(scope="module")
def vm_kernel(vm_root):
    cache = os.environ.get("FORKD_VM_CACHE") or os.path.join(vm_root, "cache")  # the image built once
    saved = os.environ.get("FORKD_VM_CACHE")
    os.environ["FORKD_VM_CACHE"] = cache
    server = ServerForKernels()
    try:
        km, kc = start_new_kernel(kernel_name="forkd-python", startup_timeout=600,
                                  env={**os.environ, "FORKD_KERNEL_ENGINE": "vm"})
        try:
            yield km, kc
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("FORKD_VM_CACHE", None)
        else:
            os.environ["FORKD_VM_CACHE"] = saved


def test_vm_notebook_branches_forks_and_checks_out(vm_kernel):
    _, kc = vm_kernel
    first = run(kc, "import random, threading, time\nx = 21", timeout=900)  # makes the base snapshot first
    assert first.ok, first.text
    assert "vm" in run(kc, "%forkd head").result
    # A thread that keeps running: the VM engine carries it, so the branch needs no lossy.
    assert run(kc, "ticks = []\nthreading.Thread(target=lambda: [ticks.append(1) or time.sleep(0.05) "
                   "for _ in range(10**6)], daemon=True).start()").ok
    assert run(kc, "%forkd branch --live", timeout=300).ok
    assert run(kc, "kids = %forkd fork -n 2", timeout=300).ok
    assert run(kc, "%forkd checkout kids[1]", timeout=120).ok
    moved = run(kc, f"{TICKED}\n(x + 1, ticked())")
    assert moved.result == "(22, True)"  # the state, and the thread still ticking in the copy
    assert run(kc, "%forkd checkout -").ok
    assert run(kc, "x").result == "21"


def test_auto_moves_a_notebook_whose_setup_leaves_a_thread_to_the_vm_engine(vm_root):
    """engine auto: the process engine refuses a base snapshot whose setup leaves a thread running
    (a fork would drop it), so the notebook runs on the VM engine, which carries it, and says so."""
    cache = os.environ.get("FORKD_VM_CACHE") or os.path.join(vm_root, "cache")
    setup = ("import threading, time\nticks = []\n"
             "threading.Thread(target=lambda: [ticks.append(1) or time.sleep(0.05) for _ in range(10**6)], "
             "name='ticker', daemon=True).start()")
    server = ServerForKernels()
    try:
        km, kc = start_new_kernel(kernel_name="forkd-python", startup_timeout=600,
                                  env={**os.environ, "FORKD_VM_CACHE": cache, "FORKD_KERNEL_ENGINE": "auto",
                                       "FORKD_KERNEL_SETUP": setup})
        try:
            first = run(kc, f"{TICKED}\nticked()", timeout=900)
            assert first.result == "True", first.text  # the setup's thread runs on in the notebook
            assert "VM engine" in first.text and "ticker" in first.text  # and the notebook was told why
            assert "vm" in run(kc, "%forkd head").result
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    finally:
        server.stop()
