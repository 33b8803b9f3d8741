"""A VM snapshot: its files, and creating one by booting a parent.

A snapshot is a directory (``devices.bin``, ``meta.json``, and the disks it pins: ``disk.raw``,
``packages.ext4``) plus ``memory.bin``, the guest's RAM as a plain file in ``mem_root``. ``create``
boots a parent with its RAM in that file (``share=on``), runs its setup through the agent, stops it,
saves device state and quits: the file *is* the snapshot's memory, nothing is copied.

Its own room because it is the one place that knows a snapshot's layout on disk (``paths``,
``record``, ``check``; branching writes snapshots through the same functions) and the
create/cancel lifecycle of a parent VM.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from typing import TYPE_CHECKING

from ..base import AgentUnreachable, Cancelled, EngineError, Handle, InvalidSpec, SnapshotSpec
from . import memory as vmem
from .channel import restore_request
from .image import ImageError
from .packages import PACKAGES_FILE, PackageNotFound, build_packages_image
from .qemu import MACHINE, tool
from .qmp import QMP, QMPError

if TYPE_CHECKING:
    from .engine import VMEngine

DEFAULT_MEM_MIB = 256


def paths(engine: "VMEngine", tag: str) -> tuple[str, str]:
    """Fresh, empty directories for snapshot ``tag``: its own (device state, meta.json, disks) and
    the one in ``mem_root`` holding its RAM file; returns (snapshot dir, memory.bin path)."""
    snap = os.path.join(engine.snap_dir, tag)
    mem = os.path.join(engine.mem_root, tag)
    for d in (snap, mem):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d, mode=0o700)
    return snap, os.path.join(mem, "memory.bin")


def record(engine: "VMEngine", tag: str, snap: str, mem_path: str, mem_mib: int, image: dict,
           lineage: list[str], packages: list[str] | None = None, **extra) -> Handle:
    """Write the finished snapshot's meta.json (last: a snapshot without one is incomplete) and
    return its handle."""
    meta = {"tag": tag, "qemu": engine.qemu_version, "machine": MACHINE, "accel": engine.accel,
            "mem_mib": mem_mib, "image": image, "lineage": lineage, "created_at": time.time(), **extra}
    if packages:
        meta["packages"] = packages
    with open(os.path.join(snap, "meta.json.tmp"), "w") as f:
        json.dump(meta, f)
    os.rename(os.path.join(snap, "meta.json.tmp"), os.path.join(snap, "meta.json"))
    handle = {"engine": engine.name, "kind": "snapshot", "tag": tag, "dir": snap, "memory": mem_path,
              "devices": os.path.join(snap, "devices.bin"), "mem_mib": mem_mib, "image": image,
              "qemu": engine.qemu_version, "accel": engine.accel}
    if extra.get("quiet"):  # nothing of the user's runs in it before a restore line: pre-run copies (warm.py)
        handle["quiet"] = True
    if os.path.exists(os.path.join(snap, "disk.raw")):
        handle["disk"] = os.path.join(snap, "disk.raw")
    if os.path.exists(os.path.join(snap, PACKAGES_FILE)):
        handle["packages_image"] = os.path.join(snap, PACKAGES_FILE)
        handle["packages"] = packages or []
    return handle


def pin_packages(source: str, snap: str) -> None:
    """Give the snapshot its own name for the packages image (a hard link): its children's page
    caches hold blocks of exactly this file, so a rebuilt or removed cache entry must not change
    what they see. A copy where a link is impossible (another filesystem, a deleted file)."""
    dest = os.path.join(snap, PACKAGES_FILE)
    try:
        os.link(source, dest)
    except OSError:
        vmem.sparse_copy(source, dest, os.path.getsize(source))
        os.chmod(dest, 0o444)


def create(engine: "VMEngine", spec: SnapshotSpec) -> Handle:
    mem_mib = spec.mem_size_mib or DEFAULT_MEM_MIB
    free = mem_root_free_mib(engine.mem_root)
    if mem_mib > free:
        raise InvalidSpec(f"mem_size_mib {mem_mib} does not fit: a VM's RAM is a file in {engine.mem_root}, whose "
                          f"filesystem has {free} MiB free")
    creating = {"handle": None, "cancelled": False}
    with engine.creating_lock:
        if spec.tag in engine.creating:
            raise EngineError(f"snapshot {spec.tag!r} is already being created")
        engine.creating[spec.tag] = creating
    try:
        snapshot = _create(engine, spec, mem_mib, creating)
    finally:
        with engine.creating_lock:  # from here on cancel() no longer finds it: cancelled now, or never
            engine.creating.pop(spec.tag, None)
    if creating["cancelled"]:
        engine.delete_snapshot(snapshot)
        raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created")
    return snapshot


FULL_BELOW = 2 << 20  # bytes: a file system with less free is taken as full when a create fails


def full_filesystem(*paths: str) -> tuple[str, int] | None:
    """(path, free bytes) of the first of ``paths`` (directories, or their nearest existing parent)
    whose file system is full, else None."""
    for path in map(_nearest_existing, paths):
        try:
            free = shutil.disk_usage(path).free
        except OSError:
            continue
        if free < FULL_BELOW:
            return path, free
    return None


def mem_root_free_mib(mem_root: str) -> int:
    return shutil.disk_usage(_nearest_existing(mem_root)).free >> 20


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _create(engine: "VMEngine", spec: SnapshotSpec, mem_mib: int, creating: dict) -> Handle:
    image = engine.image().to_dict()
    packages = packages_image(engine.cache_dir, spec.packages) if spec.packages else None
    snap, mem_path = paths(engine, spec.tag)
    handle = None
    try:
        if packages:
            pin_packages(packages, snap)
            packages = os.path.join(snap, PACKAGES_FILE)
        disk = None
        if spec.disk_mib:
            # The parent writes the raw ext4 image directly; after it is discarded the file is
            # the snapshot's frozen disk layer, and children get qcow2 overlays on it.
            disk = (os.path.join(snap, "disk.raw"), "raw")
            with open(disk[0], "wb") as f:
                f.truncate(spec.disk_mib << 20)
            tool(["mkfs.ext4", "-q", "-F", "-L", "forkd-data", disk[0]])
        t0 = time.monotonic()
        with engine.creating_lock:
            if creating["cancelled"]:
                raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created")
            handle = creating["handle"] = engine.qemu.launch("snap:" + spec.tag, image, mem_path, mem_mib,
                                                             share=True, disk=disk, packages=packages)
        channel = engine.channel(handle)
        try:
            channel.call({"action": "ping"}, timeout=engine.boot_timeout)
        except AgentUnreachable as exc:
            raise EngineError(f"the VM did not boot to its agent: {exc}; {engine.qemu.log_tail(handle)}") from exc
        boot_ms = (time.monotonic() - t0) * 1000
        channel.call(restore_request({"id": spec.tag, "role": "template", "lineage": [spec.tag]}))
        # The setup's time limit covers it all (shell, commands, code), counted from here.
        deadline = time.monotonic() + spec.setup_timeout

        def left() -> float:
            if time.monotonic() >= deadline:
                # the request's own setup: a 400, as a failing one
                raise InvalidSpec(f"snapshot {spec.tag!r}: its setup did not finish within "
                                  f"{spec.setup_timeout:g} s (setup_timeout_secs) and was stopped")
            return deadline - time.monotonic()

        def setup_call(request: dict, margin: float = 0.0) -> dict:
            try:
                return channel.call(request, timeout=left() + margin)
            except AgentUnreachable:
                left()  # past the deadline: say so
                raise

        if spec.shell == "ipython":
            reply = setup_call({"action": "shell"})
            if reply.get("error"):
                # the request's own: a shell its packages do not hold (a 400, as a failing setup)
                raise InvalidSpec(f"IPython could not start in the guest: {reply['error']} (add the Debian "
                                  f"package python3-ipython to the snapshot's packages)")
        for argv in spec.setup_commands:
            reply = setup_call({"action": "exec", "args": argv, "timeout": left()}, margin=10)
            if reply.get("exit_code") != 0:
                if reply.get("timed_out"):
                    left()
                raise InvalidSpec(f"setup command {argv!r} failed: exit {reply.get('exit_code')}: "
                                  f"{(reply.get('stderr') or reply.get('error') or '')[-1500:]}")
        if spec.setup:
            reply = setup_call({"action": "run_code", "code": spec.setup})
            if reply.get("error"):
                err = reply["error"]
                detail = f"{err.get('ename')}: {err.get('evalue')}" if isinstance(err, dict) else err
                raise InvalidSpec(f"setup failed: {detail}")
        # Threads of the requests above may still be exiting: let them finish here, once, rather
        # than in every child after every restore.
        quiet = bool(channel.call({"action": "settle"}).get("quiet"))
        engine.qemu.wait_idle(handle)
        devices = os.path.join(snap, "devices.bin")
        with QMP(handle["qmp"]) as qmp:
            qmp.execute("stop")
            qmp.execute("xen-save-devices-state", {"filename": devices, "live": False})
            vmem.finish_device_state(devices)
            with contextlib.suppress(QMPError):
                qmp.execute("quit")
        engine.kill(handle)
        handle = None
        return record(engine, spec.tag, snap, mem_path, mem_mib, image, [spec.tag],
                      sorted(set(spec.packages)) or None, boot_to_agent_ms=round(boot_ms, 1), quiet=quiet)
    except BaseException as exc:
        if handle is not None:
            engine.kill(handle)
        # Before the files go (the RAM file holds the room): a full file system, not the VM, is the
        # cause a user can act on (QEMU dies of SIGBUS when the guest touches RAM its tmpfs lacks).
        full = None if isinstance(exc, (Cancelled, InvalidSpec)) else full_filesystem(engine.mem_root, engine.snap_dir)
        shutil.rmtree(snap, ignore_errors=True)
        shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
        if full is not None:
            path, free = full
            raise EngineError(f"snapshot {spec.tag!r} failed: No space left on device: {path} had {free >> 10} KiB "
                              f"free when it failed ({exc})") from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                                                                           path)
        if creating["cancelled"] and not isinstance(exc, Cancelled):
            raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created; its VM was "
                            f"stopped") from exc
        if isinstance(exc, (QMPError, OSError, AgentUnreachable)) and not isinstance(exc, EngineError):
            raise EngineError(f"snapshot {spec.tag!r} failed: {exc}") from exc
        raise


def cancel(engine: "VMEngine", tag: str) -> bool:
    """Stop the creation of snapshot ``tag`` if it runs here (its VM is killed)."""
    with engine.creating_lock:
        creating = engine.creating.get(tag)
        if creating is None:
            return False
        creating["cancelled"] = True
        handle = creating["handle"]
    if handle is not None:
        engine.qemu.stop(handle["pid"], handle.get("start_time"))
    return True


def packages_image(cache_dir: str, packages: list[str]) -> str | None:
    """The cached read-only ext4 image of ``packages`` (built on first use)."""
    try:
        return build_packages_image(cache_dir, packages)
    except PackageNotFound as exc:
        raise InvalidSpec(str(exc)) from exc
    except ImageError as exc:
        raise EngineError(f"packages {' '.join(map(str, packages))}: {exc}") from exc


def check(engine: "VMEngine", snapshot: Handle) -> None:
    """Refuse a snapshot this engine cannot restore: not a snapshot, files gone, another QEMU or
    accelerator."""
    if snapshot.get("kind") != "snapshot":
        raise EngineError("not a VM snapshot handle")
    if not engine.alive(snapshot):
        raise EngineError(f"snapshot {snapshot.get('tag')!r} is incomplete: its files are gone "
                          f"({snapshot['memory']}, {snapshot['devices']})")
    if snapshot.get("qemu") != engine.qemu_version:
        raise EngineError(f"snapshot {snapshot.get('tag')!r} was made by {snapshot.get('qemu')!r}, this "
                          f"host runs {engine.qemu_version!r}: device state is not portable across versions")
    if snapshot.get("accel") != engine.accel:
        raise EngineError(f"snapshot {snapshot.get('tag')!r} was made under {snapshot.get('accel')}, "
                          f"this engine runs {engine.accel}")
