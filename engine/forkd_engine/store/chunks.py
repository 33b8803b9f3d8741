"""Files as ordered fixed-size chunks: each keyed by the sha256 of its content and kept compressed
with zstd; an all-zero chunk is not stored at all (a ``None`` in the file's chunk list).

A branch's chunk that differs from its parent's (the chunk at the same offset) in a few 4 KiB pages
is kept as a *page patch* against the parent's stored chunk: a bitmap of the changed pages and
those pages, each XORed with the parent's page. Guest kernels write a few pages all over RAM after
every restore (timers, allocator, page cache): a whole 4 MiB chunk for each would multiply what a
branch uploads, and most of those pages differ in a few words (a patch of XORed pages is ~9x
smaller than one of the pages themselves).

4 MiB is a multiple of the 2 MiB huge page: guest RAM changes in place, page-aligned, so fixed
chunks aligned to pages dedupe a branch against its parent as well as content-defined ones would.
"""

from __future__ import annotations

import hashlib
import os

import zstandard

CHUNK_SIZE = 4 << 20
LEVEL = 3  # zstd's default: ~the speed of level 1 on guest RAM, smaller
SEEK_DATA, SEEK_HOLE = 3, 4
_ZERO = bytes(CHUNK_SIZE)


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def is_zero(data: bytes) -> bool:
    return data == _ZERO[:len(data)]


def compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=LEVEL).compress(data)


def decompress(blob: bytes, size: int) -> bytes:
    """The chunk ``blob`` holds; raises ``ValueError`` if it is not one zstd frame of at most ``size``
    bytes (a damaged or foreign object)."""
    try:
        return zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a zstd frame: {exc}") from exc


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of ``fd`` that hold data (holes skipped), whole files where the file
    system cannot say."""
    ranges, pos = [], 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, SEEK_DATA)
            except OSError:
                break  # nothing after pos
            end = min(os.lseek(fd, start, SEEK_HOLE), size)
            ranges.append((start, end))
            pos = end
    except OSError:
        return [(0, size)]
    return ranges


def chunks_with_data(path: str) -> tuple[int, list[bool]]:
    """(file size, for each chunk index whether any of it is data): chunks wholly in holes are zero
    without reading them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        n = -(-size // CHUNK_SIZE)
        has = [False] * n
        for start, end in data_ranges(fd, size):
            for i in range(start // CHUNK_SIZE, -(-end // CHUNK_SIZE)):
                has[i] = True
        return size, has
    finally:
        os.close(fd)


PAGE = 4096
PATCH_AT_MOST = CHUNK_SIZE // 2  # a patch of more than half the chunk's pages is kept whole


def _xor(a: bytes | memoryview, b: bytes | memoryview) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def page_patch(base: bytes, data: bytes) -> bytes | None:
    """``data`` as the pages in which it differs from ``base`` (both a whole chunk): a bitmap of
    the changed pages, then each of those pages XORed with the base's page (a page where a counter
    or a pointer changed becomes zeros but for those bytes, which zstd keeps in a few bytes); None
    if more than half changed."""
    if len(base) != CHUNK_SIZE or len(data) != CHUNK_SIZE:
        return None
    a, b = memoryview(base), memoryview(data)
    pages = CHUNK_SIZE // PAGE
    bitmap = bytearray(pages // 8)
    changed = []
    for i in range(pages):
        old, new = a[i * PAGE:(i + 1) * PAGE], b[i * PAGE:(i + 1) * PAGE]
        if old != new:
            bitmap[i >> 3] |= 1 << (i & 7)
            changed.append(_xor(new, old))
            if len(changed) * PAGE > PATCH_AT_MOST:
                return None
    return bytes(bitmap) + b"".join(changed)


def apply_patch(base: bytes, patch: bytes, xor: bool = True) -> bytes:
    """The chunk ``page_patch(base, data)`` was made from; ValueError if ``patch`` does not fit.
    ``xor=False`` applies a patch whose pages replace the base's (written before patches were XORed)."""
    pages = CHUNK_SIZE // PAGE
    if len(base) != CHUNK_SIZE or len(patch) < pages // 8 or (len(patch) - pages // 8) % PAGE:
        raise ValueError("a page patch that does not fit its base chunk")
    out = bytearray(base)
    bitmap, at = patch[:pages // 8], pages // 8
    for i in range(pages):
        if bitmap[i >> 3] >> (i & 7) & 1:
            if at + PAGE > len(patch):
                raise ValueError("a page patch shorter than its bitmap says")
            page = patch[at:at + PAGE]
            out[i * PAGE:(i + 1) * PAGE] = _xor(page, base[i * PAGE:(i + 1) * PAGE]) if xor else page
            at += PAGE
    if at != len(patch):
        raise ValueError("a page patch longer than its bitmap says")
    return bytes(out)
