"""Branching a running VM into a new snapshot, which can be forked again at any depth.

- ``full``: stop, write all of RAM (the base file's data plus every page the child changed), save
  device state, resume. The pause covers the whole write.
- ``diff``: copy the base file while the child runs; stop, read only the pages the child changed
  (``/proc/PID/pagemap``: present and no longer the file's page), save device state, resume; then
  lay the pages over the copy.
- ``live``: QEMU's ``background-snapshot`` (userfaultfd write-protect): the child pauses only while
  QEMU saves device state and arms write protection; RAM streams out while it runs and is turned
  into ``memory.bin`` off the critical path. Needs the RAM file on tmpfs (uffd-wp does not cover
  other file mappings) and root (``vm.unprivileged_userfaultfd=0``).

``pause_ms`` is QEMU's own STOP → RESUME event time for every mode. A disk switches to a fresh
overlay inside the same pause and is flattened into the branch's own ``disk.raw`` afterwards.

Its own room because the three modes share one shape (pause, capture, resume, finish off the
critical path) and one lock per source VM, and nothing else in the engine pauses a running guest.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ..base import AgentUnreachable, BranchResult, EngineError, Handle, UnsupportedMode
from . import memory as vmem
from . import recovery, snapshots
from .qemu import DISK_ID, tool
from .qmp import QMP, QMPError, event_time

if TYPE_CHECKING:
    from .engine import VMEngine


def branch(engine: "VMEngine", sandbox: Handle, tag: str, lineage: list[str], mode: str) -> BranchResult:
    """Snapshot ``sandbox`` as ``tag`` in ``mode``; the result's ``ready`` completes the snapshot's files."""
    if sandbox.get("kind") != "vm":
        raise EngineError("only a running sandbox can be branched")
    if mode not in ("full", "diff", "live"):
        raise UnsupportedMode(f"unknown branch mode {mode!r}")
    if not engine.alive(sandbox):
        raise EngineError(f"QEMU process {sandbox['pid']} is gone")
    mem_size = sandbox["mem_mib"] << 20
    if mode == "live":
        fstype = vmem.filesystem_type(sandbox["base_memory"]) if os.path.exists(sandbox["base_memory"]) else ""
        if fstype and fstype not in vmem.TMPFS_TYPES:
            raise UnsupportedMode(f"live branch needs the sandbox's RAM file on tmpfs (userfaultfd "
                                  f"write-protect cannot track {fstype} file mappings); this engine's "
                                  f"mem_root {engine.mem_root} is on {fstype}")
    lock = engine.branch_lock(sandbox)
    if not lock.acquire(timeout=600):
        raise EngineError("another branch of this sandbox did not finish within 600 s")
    snap = mem_path = None
    try:
        snap, mem_path = snapshots.paths(engine, tag)
        image = None
        meta_path = os.path.join(engine.snap_dir, sandbox["snapshot"], "meta.json")
        with contextlib.suppress(OSError, ValueError), open(meta_path) as f:
            image = json.load(f)["image"]
        if image is None:
            image = engine.image().to_dict()
        if sandbox.get("packages_image"):
            # The branch's children need the very disk the source runs with (device state and
            # the guest's page cache refer to it).
            snapshots.pin_packages(held_file(sandbox, sandbox["packages_image"]), snap)
        finish_args = (tag, snap, mem_path, sandbox["mem_mib"], image, lineage, sandbox.get("packages"))
        if mode == "live":
            return _branch_live(engine, sandbox, lock, finish_args, mem_size)
        pause_ms, prepare_ms, finish = _branch_stopped(sandbox, mode, snap, mem_path, mem_size)
    except BaseException as exc:
        lock.release()
        if snap:
            shutil.rmtree(snap, ignore_errors=True)
            shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
        if isinstance(exc, (QMPError, OSError, AgentUnreachable, vmem.StreamError)):
            raise EngineError(f"branch {tag!r} ({mode}) failed: {exc}") from exc
        raise
    ready: Future = Future()

    def complete() -> None:
        try:
            finish()
            ready.set_result(snapshots.record(engine, *finish_args, branched_from=sandbox["name"], mode=mode,
                                              pause_ms=pause_ms, parent=sandbox["snapshot"]))
        except BaseException as exc:  # noqa: BLE001
            shutil.rmtree(snap, ignore_errors=True)
            shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
            ready.set_exception(exc if isinstance(exc, EngineError) else EngineError(f"branch {tag!r}: {exc}"))
        finally:
            lock.release()

    threading.Thread(target=complete, name=f"vm-branch-{tag}", daemon=True).start()
    return BranchResult(pause_ms=pause_ms, ready=ready, prepare_ms=prepare_ms)


def _freeze_disk(qmp: QMP, sandbox: Handle) -> str | None:
    """While the VM is stopped: move it onto a fresh overlay; returns the layer now frozen."""
    if not sandbox.get("disk"):
        return None
    top = next((b["inserted"]["file"] for b in qmp.execute("query-block")
                if b.get("device") == DISK_ID and b.get("inserted")), None)
    if top is None:
        raise EngineError("the sandbox's disk is not attached")
    n = len([f for f in os.listdir(sandbox["dir"]) if f.startswith("disk-") and f.endswith(".qcow2")])
    new = os.path.join(sandbox["dir"], f"disk-{n}.qcow2")
    qmp.execute("blockdev-snapshot-sync", {"device": DISK_ID, "snapshot-file": new, "format": "qcow2"})
    return top


def _flatten_disk(frozen: str | None, snap: str) -> None:
    """The branch's disk as one standalone raw file (snapshots never depend on each other)."""
    if frozen:
        tool(["qemu-img", "convert", "-U", "-O", "raw", frozen, os.path.join(snap, "disk.raw")])


def _branch_stopped(sandbox: Handle, mode: str, snap: str, mem_path: str, mem_size: int):
    """full / diff: returns (pause_ms, finish) where finish() completes memory.bin afterwards."""
    pid = sandbox["pid"]
    start, pgoff, base = vmem.find_ram_mapping(pid, mem_size)
    if pgoff != 0:
        raise EngineError("guest RAM is not mapped from the start of its file")
    devices = os.path.join(snap, "devices.bin")
    prepare_ms = 0.0
    view = None
    if mode == "diff":
        # While the child keeps running: copy the base (the file this child maps), map the copy,
        # and allocate the pages the child has changed so far (they stay changed). The pause
        # then copies only the changed pages, straight into their place.
        t0 = time.monotonic()
        vmem.sparse_copy(base, mem_path, mem_size)
        view = vmem.FileView(mem_path, mem_size)
        view.populate(vmem.private_runs(pid, start, mem_size))
        prepare_ms = round((time.monotonic() - t0) * 1000, 2)
    try:
        return _pause_and_capture(sandbox, mode, snap, mem_path, mem_size, start, base, devices, view, prepare_ms)
    finally:
        if view is not None:
            view.close()


def _pause_and_capture(sandbox, mode, snap, mem_path, mem_size, start, base, devices, view, prepare_ms):
    pid = sandbox["pid"]
    with QMP(sandbox["qmp"]) as qmp:
        resumed = False
        steps: dict = {}
        clock = time.monotonic
        own_view = None
        qmp.execute("stop")
        try:
            stop_ev = qmp.wait_event("STOP", timeout=10)
            t = clock()
            if view is None:  # full: the whole copy happens inside the pause
                vmem.sparse_copy(base, mem_path, mem_size)
                view = own_view = vmem.FileView(mem_path, mem_size)
                steps["copy_ms"] = (clock() - t) * 1000
                t = clock()
            runs = vmem.private_runs(pid, start, mem_size)
            steps["pagemap_ms"] = (clock() - t) * 1000
            t = clock()
            view.read_from(pid, start, runs)
            steps["read_ms"] = (clock() - t) * 1000
            t = clock()
            qmp.execute("xen-save-devices-state", {"filename": devices, "live": False})
            frozen = _freeze_disk(qmp, sandbox)
            steps["devices_ms"] = (clock() - t) * 1000
            qmp.execute("cont")
            resumed = True
            resume_ev = qmp.wait_event("RESUME", timeout=10)
        finally:
            if not resumed:
                with contextlib.suppress(QMPError):
                    qmp.execute("cont")
            if own_view is not None:
                own_view.close()
    pause_ms = round((event_time(resume_ev) - event_time(stop_ev)) * 1000, 2)
    vmem.finish_device_state(devices)
    dirty = sum(c for _f, c in runs) * vmem.PAGE

    def finish() -> None:
        _flatten_disk(frozen, snap)
        with open(os.path.join(snap, "branch.json"), "w") as f:
            json.dump({"mode": mode, "pause_ms": pause_ms, "prepare_ms": prepare_ms, "dirty_bytes": dirty,
                       "steps_ms": {k: round(v, 2) for k, v in steps.items()}}, f)
    return pause_ms, prepare_ms, finish


def _branch_live(engine: "VMEngine", sandbox: Handle, lock: threading.Lock, finish_args: tuple,
                 mem_size: int) -> BranchResult:
    tag, snap, mem_path = finish_args[0], finish_args[1], finish_args[2]
    rfd, wfd = os.pipe()
    qmp = QMP(sandbox["qmp"])
    try:
        try:
            qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "background-snapshot", "state": True},
                {"capability": "events", "state": True}]})
        except QMPError as exc:
            if vmem.userfaultfds(sandbox["pid"]):
                raise UnsupportedMode(f"a live branch of this sandbox failed earlier and its QEMU "
                                      f"({engine.qemu_version}) keeps that write tracking, so it refuses another "
                                      f"({exc}); branch it with mode full or diff") from exc
            raise UnsupportedMode(f"live branch is impossible on this host: QEMU refused "
                                  f"background-snapshot ({exc})") from exc
        qmp.execute("getfd", {"fdname": "forkd-live"}, fds=[wfd])
        os.close(wfd)
        wfd = -1
        frozen = None
        if sandbox.get("disk"):
            # The disk is switched at the same instant: stop, new overlay, then the background
            # snapshot (which saves device state and starts the VM itself).
            qmp.execute("stop")
            frozen = _freeze_disk(qmp, sandbox)
        qmp.execute("migrate", {"uri": "fd:forkd-live"})
        stop_ev = qmp.wait_event("STOP", timeout=30)
        resume_ev = qmp.wait_event("RESUME", timeout=60)
    except BaseException as exc:
        if wfd >= 0:
            os.close(wfd)
        os.close(rfd)
        with contextlib.suppress(QMPError):
            qmp.execute("migrate_cancel")
        with contextlib.suppress(QMPError):
            qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "background-snapshot", "state": False}]})
        with contextlib.suppress(QMPError):
            qmp.execute("cont")  # never leave the source stopped
        qmp.close()
        if isinstance(exc, EngineError):
            raise
        raise EngineError(f"live branch failed to start: {exc}") from exc
    pause_ms = round((event_time(resume_ev) - event_time(stop_ev)) * 1000, 2)
    ready: Future = Future()

    def complete() -> None:
        try:
            with io.open(rfd, "rb", buffering=1 << 20) as stream:
                device_state = vmem.split_stream(stream, mem_path, mem_size)
            # QEMU closed the stream; its MIGRATION event reports the final status.
            deadline = time.monotonic() + 60
            status = qmp.execute("query-migrate")
            while status.get("status") not in ("completed", "failed", "cancelled"):
                if time.monotonic() > deadline:
                    break
                with contextlib.suppress(QMPError):
                    qmp.wait_event("MIGRATION", timeout=max(0.01, deadline - time.monotonic()))
                status = qmp.execute("query-migrate")
            if not status or status.get("status") != "completed":
                raise EngineError(f"background snapshot ended {status and status.get('status')}: "
                                  f"{status and status.get('error-desc')}")
            with open(os.path.join(snap, "devices.bin"), "wb") as f:
                f.write(device_state)
            _flatten_disk(frozen, snap)
            with open(os.path.join(snap, "branch.json"), "w") as f:
                json.dump({"mode": "live", "pause_ms": pause_ms,
                           "qemu_downtime_ms": status.get("downtime")}, f)
            result = snapshots.record(engine, *finish_args, branched_from=sandbox["name"], mode="live",
                                      pause_ms=pause_ms, parent=sandbox["snapshot"])
            if frozen:
                result["paused"] = True  # saved from a stopped source: children need a cont
            ready.set_result(result)
        except BaseException as exc:  # noqa: BLE001
            shutil.rmtree(snap, ignore_errors=True)
            shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
            qmp.close()  # its commands would wait on a vCPU the write-protect holds
            # The stream is closed: the source must run on, or be ended saying why.
            source = recovery.after_failed_live_branch(engine, sandbox, str(exc))
            ready.set_exception(EngineError(f"live branch {tag!r} failed: {exc}; {source}"))
        else:
            with contextlib.suppress(QMPError):
                qmp.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "background-snapshot", "state": False}]})
            qmp.close()
        finally:
            lock.release()

    threading.Thread(target=complete, name=f"vm-branch-{tag}", daemon=True).start()
    return BranchResult(pause_ms=pause_ms, ready=ready)


def held_file(handle: Handle, path: str) -> str:
    """The file the VM's QEMU opened as ``path``: ``path`` while it still names that file, else
    /proc/PID/fd/N (the snapshot that named it was deleted, or its tag reused since)."""
    fd_dir = f"/proc/{handle['pid']}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            held = os.path.join(fd_dir, fd)
            with contextlib.suppress(OSError):
                if os.readlink(held) in (path, path + " (deleted)"):
                    with contextlib.suppress(OSError):
                        if os.path.samefile(held, path):
                            return path
                    return held
    raise EngineError(f"the sandbox's QEMU does not hold its packages disk {path} open")
