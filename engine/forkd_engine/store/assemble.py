"""Assembling a manifest's files, chunk by chunk, from this host's chunk cache and (for a pull) a remote
store at once.

Every chunk is decompressed and checked against its digest exactly once, then written into each
place of each file that holds it; a chunk fetched from the remote store is also kept, compressed,
in the cache (pushes and later write-backs read it there). So a pull is one pass: fetch, verify,
write into the file, keep. Zero chunks stay holes.

The figures split the pass's wall time between fetching (waiting on the remote store) and
decompressing (decompress, verify, write into the file) in proportion to the time its threads spent
on each: the steps overlap, so their wall times do not add up.

Fail closed: every file is written beside its path (``<path>.part``) and renamed into place only
once every chunk of every file has been verified; the first bad chunk stops the rest, removes the
partial files and raises ``ChunkCorrupt`` naming it. No bad chunk is kept in the cache. The caller
writes the snapshot's record after this returns, so a crash midway leaves no file under its real
name and nothing that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from . import chunks as ck
from .cache import ChunkCache
from .errors import ChunkCorrupt, StoreError
from .manifest import Manifest
from .remote import RemoteStore
from .transfer import CPU_WORKERS, IO_WORKERS, Progress, _Counter, _run, _verified


def materialise(cache: ChunkCache, manifest: Manifest, dests: dict[str, str], remote: RemoteStore | None = None,
                progress: Progress = None) -> dict:
    """Write the manifest's files named in ``dests`` (name -> path). Objects the cache lacks come from
    ``remote`` (verified as they arrive and kept in the cache); without one they must all be in the
    cache. The manifest is recorded in the cache last. ``progress(done, total)`` counts file bytes
    written. Returns {"chunks", "fetched_chunks", "fetched_bytes", "ms", "fetch_ms", "decompress_ms"}
    (``ms`` the whole pass; ``fetch_ms`` + ``decompress_ms`` its split, see above)."""
    t0 = time.perf_counter()
    missing = {c for c in _objects(manifest, dests) if not cache.has(c)}
    if missing and remote is None:
        first = next(c for c in manifest.chunks() if c in missing)
        raise StoreError(f"local store {cache.root}: {len(missing)} chunks of snapshot {manifest.digest} are "
                         f"missing (first: {first}); pull it again from a remote store")
    plain: dict[str, list[tuple[str, int, int]]] = {}  # object -> the places (file, offset, size) it fills
    patched: list[tuple[str, int, dict]] = []
    total = 0
    for name in dests:
        entry = manifest.files[name]
        for i, chunk in enumerate(entry["chunks"]):
            size = min(manifest.chunk_size, entry["size"] - i * manifest.chunk_size)
            if isinstance(chunk, dict):
                patched.append((name, i * manifest.chunk_size, chunk))
            elif chunk is not None:
                plain.setdefault(chunk, []).append((name, i * manifest.chunk_size, size))
            else:
                continue
            total += size
    counter = _Counter(total, progress)
    source = _Source(cache, remote, manifest)
    fds: dict[str, int] = {}
    try:
        for name, dest in dests.items():
            fds[name] = os.open(dest + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fds[name], manifest.files[name]["size"])  # sparse: zero chunks stay holes

        def fill(hexd: str):
            places = plain[hexd]
            data = source.get(hexd, places[0][2])
            t = time.perf_counter()
            for name, offset, size in places:
                os.pwrite(fds[name], data, offset)
                counter.add(size)
            source.busy("decompress", t)

        def fill_patched(job):
            name, offset, chunk = job
            base = source.get(chunk["base"], manifest.chunk_size)
            patch = source.get(chunk["patch"], chunk["patch_size"])
            t = time.perf_counter()
            try:
                data = ck.apply_patch(base, patch, xor=chunk.get("xor", False))
            except ValueError as exc:
                raise ChunkCorrupt(source.where(chunk["patch"]), chunk["patch"], str(exc)) from None
            if ck.digest(data) != chunk["sha256"]:
                raise ChunkCorrupt(source.where(chunk["patch"]), chunk["patch"],
                                   f"applied, it makes {ck.digest(data)}, not {chunk['sha256']}")
            os.pwrite(fds[name], data, offset)
            counter.add(len(data))
            source.busy("decompress", t)

        jobs = [(fill, h) for h in plain] + [(fill_patched, p) for p in patched]
        _run(lambda job: job[0](job[1]), jobs, IO_WORKERS if missing else CPU_WORKERS)
    except BaseException:
        for name, fd in fds.items():
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dests[name] + ".part")
        raise
    for fd in fds.values():
        os.close(fd)
    for name, dest in dests.items():  # every chunk verified: now the files take their names
        os.rename(dest + ".part", dest)
    cache.put_manifest(manifest)
    wall = (time.perf_counter() - t0) * 1000
    fetching, busy = source.seconds["fetch"], source.seconds["fetch"] + source.seconds["decompress"]
    fetch_ms = round(wall * fetching / busy, 1) if busy else 0.0
    return {"chunks": len(manifest.chunks()), "fetched_chunks": source.fetched_chunks,
            "fetched_bytes": source.fetched_bytes, "ms": round(wall, 1), "fetch_ms": fetch_ms,
            "decompress_ms": round(wall - fetch_ms, 1)}


def _objects(manifest: Manifest, dests: dict[str, str]) -> set[str]:
    """The stored objects the files in ``dests`` need (whole chunks, patches and their bases)."""
    return set(Manifest(files={n: manifest.files[n] for n in dests}, requires={}).chunks())


class _Source:
    """Each object's content, decompressed and verified: from the cache, or fetched from the remote
    (then kept in the cache). An object two jobs need at once (a patch's base that is also a chunk
    of its own) is fetched once: the second waits for the first and reads it from the cache."""

    def __init__(self, cache: ChunkCache, remote: RemoteStore | None, manifest: Manifest):
        self.cache, self.remote = cache, remote
        self.fetched_chunks = self.fetched_bytes = 0
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._fetched: set[str] = set()
        self.seconds = {"fetch": 0.0, "decompress": 0.0}  # summed over the threads

    def busy(self, step: str, since: float) -> None:
        took = time.perf_counter() - since
        with self._lock:
            self.seconds[step] += took

    def where(self, hexd: str) -> str:
        return self.remote.url if hexd in self._fetched else f"local store {self.cache.root}"

    def get(self, hexd: str, size: int) -> bytes:
        with self._lock:
            lock = self._locks.setdefault(hexd, threading.Lock())
        with lock:
            if self.cache.has(hexd):
                t = time.perf_counter()
                data = _verified(f"local store {self.cache.root}", hexd, self.cache.read(hexd), size)
                self.busy("decompress", t)
                return data
            t = time.perf_counter()
            blob = self.remote.get_chunk(hexd)
            self.busy("fetch", t)
            t = time.perf_counter()
            data = _verified(self.remote.url, hexd, blob, size)
            self.cache.write(hexd, blob)  # verified: kept compressed for pushes and write-backs
            self.busy("decompress", t)
            with self._lock:
                self._fetched.add(hexd)
                self.fetched_chunks += 1
                self.fetched_bytes += len(blob)
            return data
