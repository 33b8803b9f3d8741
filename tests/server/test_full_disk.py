"""A full data dir (a small tmpfs, filled up): writes answer 507 with the path and the free space,
reads and listings still work, nothing is marked ready, and all is well once space is freed.

The audit found every call a 500 ``database or disk is full``. Needs root (to mount the tmpfs).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile

import pytest

from forkd_server.client import Controller, ControllerError

from ..serving import Server, cleanup


@pytest.fixture
def small_disk():
    where = tempfile.mkdtemp(prefix="fkdisk")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", where], capture_output=True, text=True)
    if done.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the test needs root")
    yield where
    subprocess.run(["umount", "-l", where], check=False)
    os.rmdir(where)


def fill(path: str) -> str:
    """Write zeros until the file system is full; returns the filler's path."""
    filler = os.path.join(path, "filler")
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
    with open(filler, "ab", buffering=0) as f:  # the last bytes a 1 MiB write could not take
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_full_data_dir_is_507_and_listing_still_works(small_disk):
    token = secrets.token_hex(20)
    token_file = os.path.join(small_disk, "..", os.path.basename(small_disk) + ".token")
    with open(token_file, "w") as f:
        f.write(token)
    data = os.path.join(small_disk, "d")
    srv = Server("--token-file", token_file, data_dir=data)
    url = f"http://127.0.0.1:{srv.port}"
    try:
        srv.wait_healthy()
        ctl = Controller(url, token)
        ctl.create_snapshot("roomy", setup="x = 1")
        kid = ctl.spawn_sandboxes("roomy")[0]["id"]
        filler = fill(small_disk)
        assert shutil.disk_usage(small_disk).free < (1 << 20)

        def refused(fn, *args, **kwargs):
            with pytest.raises(ControllerError) as info:
                fn(*args, **kwargs)
            assert info.value.status == 507, info.value.body
            body = info.value.body
            assert body["path"] == os.path.realpath(data) and body["free_bytes"] < (1 << 20)
            assert f"the data dir {os.path.realpath(data)} is full" in body["error"] and "free space" in body["error"]

        refused(ctl.create_snapshot, "nope")
        refused(ctl.spawn_sandboxes, "roomy")
        refused(ctl.branch_sandbox, kid, tag="nope-b")
        # reads and listings work; nothing new is there, let alone ready
        assert [s["id"] for s in ctl.list_sandboxes()] == [kid]
        assert [(s["tag"], s["status"]) for s in ctl.list_snapshots()] == [("roomy", "ready")]
        assert ctl.get_sandbox(kid)["status"] == "running"
        assert ctl.eval_code(kid, "x + 1")["result"] == "2"
        assert {n["id"] for n in ctl.tree()} == {"roomy", kid}

        os.unlink(filler)  # space again: the same calls go through
        assert ctl.create_snapshot("later")["status"] == "ready"
        assert ctl.branch_sandbox(kid, tag="later-b")["status"] == "ready"
    finally:
        cleanup(url, token)
        srv.stop()
        os.unlink(token_file)


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64")
def test_a_vm_create_whose_ram_tmpfs_runs_out_is_507_naming_it(small_disk, monkeypatch):
    """The room for a VM's RAM is checked before it boots, but others may take it meanwhile: QEMU
    then dies of SIGBUS when the guest touches RAM the tmpfs lacks. That said only "Connection
    reset"; it is 507 naming the RAM's file system and its free space."""
    from forkd_engine.vm import VMEngine, snapshots

    from forkd_server.controller import Controller
    from forkd_server.errors import EngineFailure, NotFound
    from forkd_server.controller.storage import full_disk_error, is_disk_full

    data = tempfile.mkdtemp(prefix="fkvd")
    mem_root = os.path.join(small_disk, "ram")   # 32 MiB for a guest of 256 MiB
    engine = VMEngine(os.path.join(data, "vm"), mem_root=mem_root,
                      cache_dir=os.environ.get("FORKD_VM_CACHE") or os.path.join(data, "cache"))
    ctl = Controller(data, engines={"vm": engine})
    monkeypatch.setattr(snapshots, "mem_root_free_mib", lambda root: 1 << 20)  # the check passed, then...
    try:
        with pytest.raises(EngineFailure) as failure:
            ctl.create_snapshot("ram", engine="vm", setup="x = 1")
        assert "No space left on device" in str(failure.value) and mem_root in str(failure.value)
        assert is_disk_full(failure.value)
        answer = full_disk_error(ctl.data_dir, failure.value)
        assert answer.status == 507 and answer.fields["path"] == os.path.realpath(mem_root)
        assert answer.fields["free_bytes"] is not None and f"{os.path.realpath(mem_root)} (used by" in answer.message
        with pytest.raises(NotFound):
            ctl.get_snapshot("ram")  # nothing of it stays
    finally:
        ctl.close()
        shutil.rmtree(data, ignore_errors=True)
