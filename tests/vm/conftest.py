"""VM engine fixtures: one engine, one guest image and one booted parent snapshot per session.

Under TCG a boot takes ~3-4 s, so everything else is spawned (restored) from the session's
snapshot, which takes ~0.1-0.2 s per child.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest

from forkd_engine import SnapshotSpec

from .. import streams

QEMU_MISSING = shutil.which("qemu-system-x86_64") is None
requires_qemu = pytest.mark.skipif(
    QEMU_MISSING, reason="qemu-system-x86_64 is not installed (scripts/setup.sh installs it)")

PARENT_SETUP = """
import os, random, time, hashlib
marker = "parent-state"
counter = 1
blob = os.urandom(4 << 20)
blob_sha = hashlib.sha256(blob).hexdigest()
first_random = random.random()
"""


@pytest.fixture(scope="session")
def vm_root():
    path = tempfile.mkdtemp(prefix="fkvm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vm_engine(vm_root):
    if QEMU_MISSING:
        pytest.skip("qemu-system-x86_64 is not installed (scripts/setup.sh installs it)")
    from forkd_engine.vm import VMEngine
    engine = VMEngine(os.path.join(vm_root, "vm"),
                      cache_dir=os.environ.get("FORKD_VM_CACHE") or os.path.join(vm_root, "cache"))
    yield engine
    engine.close()
    shutil.rmtree(engine.mem_root, ignore_errors=True)


@pytest.fixture(scope="session")
def parent(vm_engine):
    handle = vm_engine.create_snapshot(SnapshotSpec(tag="parent", setup=PARENT_SETUP, mem_size_mib=256))
    yield handle
    vm_engine.delete_snapshot(handle)


# Debian's numpy on a packages disk, a data disk, and generators of every kind (tests/streams.py).
NUMPY_SETUP = """
import hashlib, os
import numpy as np
base = np.arange(1_000_000, dtype=np.float64)
first_draw = np.random.rand()
open('/data/note', 'w').write('from the parent')
os.sync()
""" + streams.SETUP


@pytest.fixture(scope="session")
def np_snap(vm_engine):
    """Booted once per session (under TCG a boot with numpy takes ~10 s): test_vm_packages.py and
    test_vm_fork_correctness.py share it."""
    handle = vm_engine.create_snapshot(SnapshotSpec(tag="numpy", mem_size_mib=256, disk_mib=16,
                                                    packages=["python3-numpy"], setup=NUMPY_SETUP))
    yield handle
    vm_engine.delete_snapshot(handle)


@pytest.fixture
def kids(vm_engine):
    """Handles spawned in a test; all killed afterwards."""
    made: list = []
    yield made
    for h in made:
        vm_engine.kill(h)


@contextlib.contextmanager
def vm_controller(vm_engine, tag: str, setup: str):
    """A controller on the VM engine with one 256 MiB snapshot ``tag`` made from ``setup``; on
    leaving, every sandbox and snapshot it made is gone."""
    from forkd_server.controller import Controller
    path = tempfile.mkdtemp(prefix="fkvc")
    c = Controller(path, engines={"vm": vm_engine})
    try:
        c.create_snapshot(tag, engine="vm", setup=setup, mem_size_mib=256)
        yield c
    finally:
        c.recovery.wait()
        c.stores.close()  # its worker writes into the shared engine's store: stopped before the session's rmtree
        for sb in c.list_sandboxes():
            c.kill_sandbox(sb["id"])
        for snap in c.list_snapshots():
            c.delete_snapshot(snap["tag"])
        c.registry.close()
        shutil.rmtree(path, ignore_errors=True)


def run(engine, handle, code: str, timeout: float = 60):
    reply = engine.call(handle, {"action": "run_code", "code": code}, timeout=timeout)
    assert reply["error"] is None, reply
    return reply["result"]["text/plain"] if reply["result"] else None


def ev(engine, handle, code: str, timeout: float = 60):
    reply = engine.call(handle, {"action": "eval", "code": code}, timeout=timeout)
    assert reply.get("exit_code") == 0, reply
    return reply["result"]
