"""Moving a snapshot's files: into this host's chunk cache (``persist``), and its chunks between the
cache and a remote store (``push``, ``pull``). Writing files back, from the cache and a remote at
once, is ``assemble.materialise``.

Work runs on a few threads: hashing, zstd and obstore release the GIL. ``progress(done, total)``
is called with byte counts as chunks are done.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from . import chunks as ck
from .cache import ChunkCache
from .errors import ChunkCorrupt, NotInStore, StoreError
from .manifest import Manifest, content_digest, parse_digest
from .remote import RemoteStore

CPU_WORKERS = min(4, max(2, len(os.sched_getaffinity(0))))  # persist, materialise: hashing and zstd
IO_WORKERS = 8  # push, pull: mostly waiting on the store, whose round trips overlap
Progress = Callable[[int, int], None] | None


def _run(fn, items, workers: int = CPU_WORKERS) -> list:
    """``fn`` over ``items`` on a few threads; the first failure stops the rest and is raised."""
    if not items:
        return []
    stop = threading.Event()

    def guarded(item):
        if stop.is_set():
            return None
        try:
            return fn(item)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="forkd-store") as pool:
        futures = [pool.submit(guarded, item) for item in items]
        results, first = [], None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below, the first one
                first = first or exc
        if first is not None:
            raise first
        return results


class _Counter:
    def __init__(self, total: int, progress: Progress):
        self.done, self.total, self.progress = 0, total, progress
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            done = self.done
        if self.progress:
            self.progress(done, self.total)


def persist(cache: ChunkCache, files: dict[str, str], requires: dict, meta: dict, progress: Progress = None,
            parent: Manifest | None = None) -> Manifest:
    """Chunk ``files`` (name -> path) into ``cache`` and record their manifest there (last). With
    ``parent`` (the snapshot this one was branched from), a chunk that changed in a few pages is kept
    as a page patch against the parent's chunk at the same offset."""
    layout = {name: ck.chunks_with_data(path) for name, path in files.items()}
    jobs = [(name, i) for name, (_size, has) in layout.items() for i, data in enumerate(has) if data]
    entries: dict[tuple[str, int], object] = {}
    counter = _Counter(sum(min(ck.CHUNK_SIZE, layout[n][0] - i * ck.CHUNK_SIZE) for n, i in jobs), progress)
    fds = {name: os.open(path, os.O_RDONLY) for name, path in files.items()}
    try:
        def one(job):
            name, i = job
            data = os.pread(fds[name], ck.CHUNK_SIZE, i * ck.CHUNK_SIZE)
            if ck.is_zero(data):
                entries[job] = None
            else:
                entries[job] = _entry(cache, data, _parent_entry(parent, name, i))
            counter.add(len(data))

        _run(one, jobs)
    finally:
        for fd in fds.values():
            os.close(fd)
    manifest = Manifest(files={name: {"size": size, "chunks": [entries.get((name, i)) for i in range(len(has))]}
                               for name, (size, has) in layout.items()},
                        requires=requires, meta=meta)
    cache.put_manifest(manifest)
    return manifest


def _parent_entry(parent: Manifest | None, name: str, i: int):
    if parent is None or name not in parent.files:
        return None
    chunks = parent.files[name]["chunks"]
    return chunks[i] if i < len(chunks) else None


def _entry(cache: ChunkCache, data: bytes, before):
    """The manifest entry of a non-zero chunk, its objects written to the cache: the parent's own
    entry when nothing changed, a page patch against the parent's stored chunk when few pages did,
    else the chunk itself."""
    hexd = ck.digest(data)
    if before is not None and content_digest(before) == hexd:
        return before
    if before is not None and not cache.has(hexd):
        base = before["base"] if isinstance(before, dict) else before
        if cache.has(base):
            patch = ck.page_patch(ck.decompress(cache.read(base), ck.CHUNK_SIZE), data)
            if patch is not None:
                patch_hex = ck.digest(patch)
                if not cache.has(patch_hex):
                    cache.write(patch_hex, ck.compress(patch))
                return {"sha256": hexd, "base": base, "patch": patch_hex, "patch_size": len(patch), "xor": True}
    if not cache.has(hexd):
        cache.write(hexd, ck.compress(data))
    return hexd


def _verified(where: str, hexd: str, blob: bytes, size: int) -> bytes:
    try:
        data = ck.decompress(blob, size)
    except ValueError as exc:
        raise ChunkCorrupt(where, hexd, str(exc)) from None
    if len(data) != size:
        raise ChunkCorrupt(where, hexd, f"{len(data)} bytes where the manifest says {size}")
    if ck.digest(data) != hexd:
        raise ChunkCorrupt(where, hexd, f"its content hashes to {ck.digest(data)}")
    return data


def push(cache: ChunkCache, remote: RemoteStore, digest: str, tag: str | None = None,
         progress: Progress = None, held: frozenset[str] | set[str] = frozenset(), look_first: bool = False) -> dict:
    """Copy a snapshot from the cache to ``remote``: the chunks it lacks first, the manifest last,
    then the tag. Returns {"digest", "chunks", "uploaded_chunks", "uploaded_bytes", "lookups"}.

    Every chunk is written in create mode, which never rewrites an object the store has; a lookup
    first only spares sending one the store holds. So the chunks the store is believed to hold
    (``held``: those of snapshots pushed to it before, e.g. a diff branch's parent) are looked up
    first, and the others are sent at once: a first push makes no lookup. Once a send finds its
    chunk there already (another host pushed the same content, or a push was cut short), the rest
    are looked up first; ``look_first`` starts so (a push resumed after the server's end)."""
    manifest = cache.get_manifest(digest)
    if manifest is None:
        raise NotInStore(f"local store {cache.root} holds no manifest {digest}")
    todo = manifest.chunks()
    counter = _Counter(sum(cache.size(c) for c in todo), progress)
    uploaded = {"chunks": 0, "bytes": 0, "lookups": 0}
    lock = threading.Lock()
    looking = threading.Event()
    if look_first:
        looking.set()

    def one(hexd):
        size = cache.size(hexd)
        if looking.is_set() or hexd in held:
            with lock:
                uploaded["lookups"] += 1
            wrote = not remote.has_chunk(hexd) and remote.put_chunk(hexd, cache.read(hexd))
        else:
            wrote = remote.put_chunk(hexd, cache.read(hexd))
            if not wrote:
                looking.set()
        if wrote:
            with lock:
                uploaded["chunks"] += 1
                uploaded["bytes"] += size
        counter.add(size)

    _run(one, todo, IO_WORKERS)
    remote.put_manifest(digest[7:], manifest.to_bytes())
    if tag:
        remote.put_tag(tag, digest)
    return {"digest": digest, "chunks": len(todo), "uploaded_chunks": uploaded["chunks"],
            "uploaded_bytes": uploaded["bytes"], "lookups": uploaded["lookups"]}


def fetch_manifest(remote: RemoteStore, *, tag: str | None = None, digest: str | None = None) -> Manifest:
    """The manifest named by ``digest`` or by ``tag`` in ``remote``, checked against its name."""
    if digest is None:
        digest = remote.get_tag(tag)
    try:
        hexd = parse_digest(digest)
    except ValueError as exc:
        raise StoreError(f"store {remote.url}: {exc}") from None
    try:
        data = remote.get_manifest(hexd)
    except NotInStore:
        raise NotInStore(f"store {remote.url} holds no snapshot sha256:{hexd}") from None
    if ck.digest(data) != hexd:
        raise ChunkCorrupt(remote.url, f"manifests/{hexd}", f"its content hashes to sha256:{ck.digest(data)}")
    return Manifest.from_bytes(data)


def pull(cache: ChunkCache, remote: RemoteStore, manifest: Manifest, progress: Progress = None) -> dict:
    """Fetch the chunks of ``manifest`` that the cache lacks, verifying each as it arrives; on the
    first mismatch everything stops (``ChunkCorrupt`` names the chunk) and no bad chunk is kept.
    The manifest is recorded in the cache last. Returns {"chunks", "fetched_chunks", "fetched_bytes"}."""
    sizes = _chunk_sizes(manifest)
    missing = [c for c in manifest.chunks() if not cache.has(c)]
    counter = _Counter(sum(sizes[c] for c in missing), progress)
    fetched = {"bytes": 0}
    lock = threading.Lock()

    def one(hexd):
        blob = remote.get_chunk(hexd)
        _verified(remote.url, hexd, blob, sizes[hexd])
        cache.write(hexd, blob)
        with lock:
            fetched["bytes"] += len(blob)
        counter.add(sizes[hexd])

    _run(one, missing, IO_WORKERS)
    cache.put_manifest(manifest)
    return {"chunks": len(manifest.chunks()), "fetched_chunks": len(missing), "fetched_bytes": fetched["bytes"]}


def _chunk_sizes(manifest: Manifest) -> dict[str, int]:
    """Each object's uncompressed size (the last chunk of a file may be short; a patch's base is a
    whole chunk)."""
    sizes = {}
    for entry in manifest.files.values():
        for i, chunk in enumerate(entry["chunks"]):
            if isinstance(chunk, dict):
                sizes[chunk["base"]] = manifest.chunk_size
                sizes[chunk["patch"]] = chunk["patch_size"]
            elif chunk is not None:
                sizes[chunk] = min(manifest.chunk_size, entry["size"] - i * manifest.chunk_size)
    return sizes


def delete(remote: RemoteStore, digest: str, grace_seconds: float = 3600.0) -> dict:
    """Delete a snapshot's manifest from ``remote`` (and the tags naming it), then sweep: remove
    every chunk no remaining manifest lists, unless younger than ``grace_seconds`` (a push under way
    writes its chunks before its manifest): those are counted as ``waiting_chunks``, for a later
    delete to sweep. Mark-and-sweep: chunks another manifest uses stay."""
    import datetime

    hexd = parse_digest(digest)
    for meta in remote.list("tags/"):
        try:
            if remote.get_tag(meta["path"][5:]) == f"sha256:{hexd}":
                remote.delete(meta["path"])
        except NotInStore:
            continue
    remote.delete(f"manifests/{hexd}")
    marked: set[str] = set()
    for meta in remote.list("manifests/"):
        try:
            marked.update(fetch_manifest(remote, digest=meta["path"].rsplit("/", 1)[1]).chunks())
        except NotInStore:  # deleted since the listing (another delete at once): its chunks are no one's
            continue
    cutoff = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=grace_seconds)
    removed = waiting = 0
    for meta in remote.list("chunks/"):
        name = meta["path"].rsplit("/", 1)[1]
        if name in marked:
            continue
        if meta["last_modified"] >= cutoff:
            waiting += 1  # listed by no manifest, but young enough to be a push's under way
            continue
        try:
            remote.delete(meta["path"])
        except NotInStore:  # swept meanwhile by another delete
            continue
        removed += 1
    return {"removed_chunks": removed, "kept_chunks": len(marked), "waiting_chunks": waiting}
