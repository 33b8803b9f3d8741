"""VM snapshots that outlive tmpfs: each one's files kept in this host's chunk store, and written
back where the engine expects them when they are gone (after a reboot, or a pull from another host).

A snapshot's store entry is a *pin* named by its tag (``ChunkCache.pin``) naming its manifest:
``memory.bin`` (guest RAM, in tmpfs), ``devices.bin``, and its disks when it has them, plus its
meta.json as the manifest's ``meta`` and what a restore depends on as ``requires``.

Its own room because it is the one bridge between a snapshot's layout (``snapshots``) and the store
(``forkd_engine.store``): persist, re-materialise, import.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from typing import TYPE_CHECKING

from ..base import EngineError, Handle
from ..store import ChunkCache, Manifest, RemoteStore, StoreError, materialise, persist
from . import snapshots
from .packages import PACKAGES_FILE
from .qemu import MACHINE

if TYPE_CHECKING:
    from .engine import VMEngine

_FILES = (("memory.bin", "memory"), ("devices.bin", "devices"), ("disk.raw", "disk"), (PACKAGES_FILE, "packages_image"))
_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()


def _lock(engine: "VMEngine", tag: str) -> threading.Lock:
    with _locks_lock:
        return _locks.setdefault(f"{engine.data_dir}\0{tag}", threading.Lock())


def cpu_model(accel: str) -> str:
    """The CPU the guest runs on, as QEMU is told (``qemu.Qemu.command``): TCG's ``max`` is the same
    everywhere; under KVM it is the host's own CPU, so its model name is part of it."""
    if accel != "kvm":
        return "max"
    name = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"host ({name})"


def host_requires(engine: "VMEngine") -> dict:
    """What this host offers a restore, in the manifest's ``requires`` terms."""
    return {"qemu": engine.qemu_version, "machine": MACHINE, "accel": engine.accel, "cpu": cpu_model(engine.accel)}


def files_of(handle: Handle) -> dict[str, str]:
    return {name: handle[key] for name, key in _FILES if handle.get(key)}


def store_snapshot(engine: "VMEngine", handle: Handle, progress=None) -> str:
    """Write a ready snapshot's files into the chunk store and pin them under its tag; returns the
    manifest's digest."""
    tag = handle["tag"]
    with _lock(engine, tag):
        try:
            with open(os.path.join(handle["dir"], "meta.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError) as exc:
            raise EngineError(f"snapshot {tag!r} cannot be stored: its meta.json is unreadable ({exc}); it was "
                              f"deleted, or its files are damaged") from exc
        requires = dict(host_requires(engine), mem_mib=handle["mem_mib"],
                        image=(handle.get("image") or {}).get("key"))
        # a branch's chunks that changed in a few pages become page patches against its parent's
        parent = stored_manifest(engine, {"tag": meta["parent"]}) if meta.get("parent") else None
        try:
            manifest = persist(engine.store, files_of(handle), requires, meta, progress, parent=parent)
        except OSError as exc:
            raise EngineError(f"snapshot {tag!r}: writing it to the local store {engine.store.root} failed: {exc}") from exc
        engine.store.pin(tag, manifest.digest)
        if not os.path.exists(os.path.join(handle["dir"], "meta.json")):  # deleted meanwhile
            engine.store.unpin(tag)
            raise EngineError(f"snapshot {tag!r} was deleted while it was being stored")
        return manifest.digest


def stored_manifest(engine: "VMEngine", handle: Handle) -> Manifest | None:
    digest = engine.store.pins().get(handle.get("tag", "")) if handle.get("tag") else None
    return engine.store.get_manifest(digest) if digest else None


def restorable(engine: "VMEngine", handle: Handle) -> bool:
    """The store holds this snapshot (its pin and manifest), so missing files can be written back."""
    tag = handle.get("tag")
    return bool(tag) and os.path.exists(os.path.join(engine.store.root, "pins", tag)) and \
        os.path.exists(os.path.join(handle["dir"], "meta.json"))


def ensure_files(engine: "VMEngine", handle: Handle, manifest: Manifest | None = None,
                 remote: RemoteStore | None = None) -> dict | None:
    """Write back the snapshot files that are gone (``memory.bin`` after a reboot, or once stored)
    from the store: the local one, and ``remote`` for the chunks it lacks, fetched, verified and
    written in one pass. ``manifest`` is the snapshot's when the local store may not hold it. Returns
    the pass's figures (``assemble.materialise``), None if no file was gone. Raises ``EngineError``
    saying what is missing when the store cannot; a failure of ``remote`` is its ``StoreError``."""
    paths = files_of(handle)
    if all(os.path.exists(p) for p in paths.values()):
        return None
    with _lock(engine, handle["tag"]):
        missing = {name: p for name, p in paths.items() if not os.path.exists(p)}
        if not missing:
            return None
        manifest = manifest or stored_manifest(engine, handle)
        if manifest is None:
            raise EngineError(f"snapshot {handle['tag']!r} is incomplete: {', '.join(missing.values())} are gone "
                              f"and the local store holds no copy of it")
        _check_room(engine, manifest, missing)
        for p in missing.values():
            os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
        try:
            return materialise(engine.store, manifest, missing, remote=remote)
        except StoreError as exc:
            if remote is not None:
                raise
            raise EngineError(f"snapshot {handle['tag']!r}: writing its files back from the local store "
                              f"failed: {exc}") from exc
        except OSError as exc:
            raise EngineError(f"snapshot {handle['tag']!r}: writing its files back failed: {exc}") from exc


def release_files(engine: "VMEngine", handle: Handle) -> bool:
    """Remove a stored snapshot's ``memory.bin`` (its RAM in tmpfs); ``ensure_files`` writes it back
    from the store. Only when the store holds the snapshot (its pin and manifest): never the one copy."""
    manifest = stored_manifest(engine, handle)
    if manifest is None or not engine.store.has_all(manifest):
        return False
    with _lock(engine, handle["tag"]):
        try:
            os.unlink(handle["memory"])
        except FileNotFoundError:
            pass
    return True


def _check_room(engine: "VMEngine", manifest: Manifest, files: dict[str, str]) -> None:
    ram = manifest.files.get("memory.bin", {}).get("size", 0) >> 20
    if "memory.bin" in files:
        os.makedirs(engine.mem_root, mode=0o700, exist_ok=True)
        free = snapshots.mem_root_free_mib(engine.mem_root)
        if ram > free:  # a full file system, said as one (the server answers 507 naming the path)
            raise EngineError(f"snapshot {manifest.meta.get('tag')!r} needs {ram} MiB of RAM file in "
                              f"{engine.mem_root}, whose file system has {free} MiB free") \
                from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), engine.mem_root)


def import_snapshot(engine: "VMEngine", manifest: Manifest, tag: str, lineage: list[str],
                    remote: RemoteStore | None = None, progress=None) -> tuple[Handle, dict]:
    """Make snapshot ``tag`` on this host from a manifest (a pull): its restore dependencies checked,
    its files written (the chunks the store lacks fetched from ``remote`` in the same pass, each
    verified once), its meta.json last. Returns its handle and the pull's figures."""
    manifest.check(host_requires(engine))
    digest = manifest.digest
    engine.store.pin(tag, digest)  # what this pull fetches stays while it runs
    snap, mem_path = snapshots.paths(engine, tag)
    try:
        dests = {name: (mem_path if name == "memory.bin" else os.path.join(snap, name)) for name in manifest.files}
        _check_room(engine, manifest, dests)
        figures = materialise(engine.store, manifest, dests, remote=remote, progress=progress)
        meta = manifest.meta
        extra = {k: v for k, v in meta.items() if k in ("boot_to_agent_ms", "quiet")}
        return snapshots.record(engine, tag, snap, mem_path, manifest.requires["mem_mib"], meta.get("image") or {},
                                lineage, meta.get("packages"), pulled_from=digest, **extra), figures
    except BaseException:
        engine.store.unpin(tag)
        engine.delete_snapshot({"dir": snap, "memory": mem_path})
        raise
