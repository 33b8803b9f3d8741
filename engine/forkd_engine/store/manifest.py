"""A snapshot's manifest: its files as ordered chunk digests, what a restore depends on, and the
snapshot's own record. Its identity is the sha256 of its canonical JSON (sorted keys, no spaces),
which is also the exact byte string kept in a store, so anyone can check a manifest against its name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .chunks import CHUNK_SIZE
from .errors import Incompatible

FORMAT = 1
# What a restore depends on, checked in this order (the first that differs is named). ``mem_mib``
# and ``image`` are recorded, not compared: the RAM size travels with the snapshot and a restored
# guest runs the kernel and agent its RAM holds, whatever image this host would boot.
CHECKED = ("qemu", "machine", "accel", "cpu")


@dataclass
class Manifest:
    # name -> {"size": bytes, "chunks": [entry]}; an entry is None (an all-zero chunk), the hex sha256
    # of the chunk (an object of its own), or a page patch: {"sha256": the chunk's, "base": an
    # object's hex, "patch": the patch object's hex, "patch_size": its bytes uncompressed, "xor": true
    # (its pages XORed with the base's; absent in patches whose pages replace the base's)}
    files: dict[str, dict]
    requires: dict                      # qemu, machine, accel, cpu, mem_mib, image
    meta: dict = field(default_factory=dict)  # the snapshot's record (tag, lineage, ...)
    chunk_size: int = CHUNK_SIZE

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "chunk_size": self.chunk_size, "compression": "zstd", "files": self.files,
               "requires": self.requires, "meta": self.meta}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        doc = json.loads(data)
        if doc.get("format") != FORMAT or doc.get("compression") != "zstd":
            raise Incompatible("this manifest", "format", f"{doc.get('format')}/{doc.get('compression')}",
                               f"{FORMAT}/zstd")
        return cls(files=doc["files"], requires=doc["requires"], meta=doc.get("meta") or {},
                   chunk_size=doc["chunk_size"])

    def chunks(self) -> list[str]:
        """Every distinct stored object (whole chunks, patches and their bases), in file order."""
        seen: dict[str, None] = {}
        for f in self.files.values():
            for c in f["chunks"]:
                if isinstance(c, dict):
                    seen.setdefault(c["base"])
                    seen.setdefault(c["patch"])
                elif c is not None:
                    seen.setdefault(c)
        return list(seen)

    def stored_bytes(self, sizes: dict[str, int]) -> int:
        return sum(sizes.get(c, 0) for c in self.chunks())

    def check(self, host: dict) -> None:
        """Raise ``Incompatible`` naming the first restore dependency this ``host`` does not meet."""
        for key in CHECKED:
            if self.requires.get(key) != host.get(key):
                raise Incompatible(f"snapshot {self.meta.get('tag', '?')} ({self.digest[:19]})", key,
                                   self.requires.get(key), host.get(key))


def parse_digest(text: str) -> str:
    """The 64 hex digits of ``sha256:<hex>`` (or bare hex); ValueError otherwise."""
    hexpart = text[7:] if isinstance(text, str) and text.startswith("sha256:") else text
    if not isinstance(hexpart, str) or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a snapshot digest: {text!r} (expected sha256: and 64 hex digits)")
    return hexpart


def content_digest(entry) -> str | None:
    """The sha256 of the chunk an entry stands for (None: all zero)."""
    return entry["sha256"] if isinstance(entry, dict) else entry
