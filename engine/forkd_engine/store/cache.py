"""This host's own store: a folder of chunks and manifests (the same layout as a remote store) with
*pins* and a size cap.

- ``pins/<name>`` holds the digest of a manifest a snapshot on this host uses (its name is the
  snapshot's tag): every chunk of a pinned manifest stays. This is what makes a VM snapshot outlive
  its RAM file in tmpfs.
- Everything else is cache: chunks a pull fetched or a deleted snapshot left. Over the cap, the
  least recently used of those go first (a read touches a chunk's mtime). The cap is a target for
  what is not pinned; pinned chunks are never evicted, even past it.

Garbage collection is mark-and-sweep: the mark is every chunk of every pinned manifest, the sweep
removes unmarked chunks oldest first. A chunk written in the last ``GRACE`` seconds is never swept:
a persist or a pull writes its chunks before the manifest that pins them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from .manifest import Manifest

DEFAULT_CAP = 8 << 30
GRACE = 900.0  # seconds a fresh chunk is safe from eviction (its manifest may not be written yet)


class ChunkCache:
    def __init__(self, root: str, cap_bytes: int = DEFAULT_CAP):
        self.root = os.path.realpath(root)
        self.cap_bytes = cap_bytes
        for sub in ("chunks", "manifests", "pins"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        self.lock = threading.RLock()

    # --- chunks ----------------------------------------------------------------------------------

    def chunk_path(self, hexd: str) -> str:
        return os.path.join(self.root, "chunks", hexd[:2], hexd)

    def has(self, hexd: str) -> bool:
        return os.path.exists(self.chunk_path(hexd))

    def read(self, hexd: str) -> bytes:
        path = self.chunk_path(hexd)
        with open(path, "rb") as f:
            blob = f.read()
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return blob

    def write(self, hexd: str, blob: bytes) -> bool:
        """Keep a verified chunk; False if it was already here. Atomic: a crash leaves no half chunk."""
        path = self.chunk_path(hexd)
        if os.path.exists(path):
            return False
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.rename(tmp, path)
        return True

    def size(self, hexd: str) -> int:
        try:
            return os.path.getsize(self.chunk_path(hexd))
        except OSError:
            return 0

    # --- manifests and pins ----------------------------------------------------------------------

    def put_manifest(self, manifest: Manifest) -> str:
        digest = manifest.digest
        path = os.path.join(self.root, "manifests", digest[7:])
        if not os.path.exists(path):
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(manifest.to_bytes())
            os.rename(tmp, path)
        return digest

    def get_manifest(self, digest: str) -> Manifest | None:
        try:
            with open(os.path.join(self.root, "manifests", digest.removeprefix("sha256:")), "rb") as f:
                return Manifest.from_bytes(f.read())
        except FileNotFoundError:
            return None

    def has_all(self, manifest: Manifest) -> bool:
        return all(self.has(c) for c in manifest.chunks())

    def pin(self, name: str, digest: str) -> None:
        path = os.path.join(self.root, "pins", name)
        with open(path + ".tmp", "w") as f:
            f.write(digest)
        os.rename(path + ".tmp", path)

    def unpin(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.root, "pins", name))

    def pins(self) -> dict[str, str]:
        out = {}
        for name in os.listdir(os.path.join(self.root, "pins")):
            if not name.endswith(".tmp"):
                with contextlib.suppress(OSError), open(os.path.join(self.root, "pins", name)) as f:
                    out[name] = f.read().strip()
        return out

    # --- eviction (mark and sweep) ---------------------------------------------------------------

    def usage(self) -> dict:
        pinned = self._marked()
        total = unpinned = 0
        for hexd, size, _mtime in self._chunks():
            total += size
            if hexd not in pinned:
                unpinned += size
        return {"bytes": total, "unpinned_bytes": unpinned, "cap_bytes": self.cap_bytes}

    def _marked(self) -> set[str]:
        marked: set[str] = set()
        for digest in set(self.pins().values()):
            manifest = self.get_manifest(digest)
            if manifest is not None:
                marked.update(manifest.chunks())
        return marked

    def _chunks(self):
        base = os.path.join(self.root, "chunks")
        for sub in os.scandir(base):
            if sub.is_dir():
                for entry in os.scandir(sub.path):
                    if not entry.name.endswith(".tmp"):
                        st = entry.stat()
                        yield entry.name, st.st_size, st.st_mtime

    def evict(self) -> int:
        """Remove the least recently used unpinned chunks (and manifests no pin names) until the
        cache is within its cap; returns bytes freed."""
        with self.lock:
            marked = self._marked()
            chunks = list(self._chunks())
            total = sum(size for _h, size, _m in chunks)
            freed = 0
            fresh = time.time() - GRACE
            for hexd, size, mtime in sorted((c for c in chunks if c[0] not in marked), key=lambda c: c[2]):
                if total - freed <= self.cap_bytes or mtime > fresh:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.chunk_path(hexd))
                freed += size
            if freed:
                pinned = {d.removeprefix("sha256:") for d in self.pins().values()}
                for entry in os.scandir(os.path.join(self.root, "manifests")):
                    if entry.name not in pinned and not entry.name.endswith(".tmp"):
                        manifest = self.get_manifest(entry.name)
                        if manifest is None or not self.has_all(manifest):
                            os.unlink(entry.path)
            return freed
