"""Files as ordered fixed-size chunks: each keyed by the sha256 of its content and kept compressed
with zstd; an all-zero chunk is not stored at all (a ``None`` in the file's chunk list).

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
