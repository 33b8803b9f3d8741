"""Guest memory on the host: copying snapshot files sparsely, finding a VM's RAM mapping, reading
the pages a child changed (``/proc/PID/pagemap``), and turning a QEMU migration stream into a
``memory.bin`` plus a device-state file.

The migration stream format (QEMU 7.2, precopy): ``QEVM`` + version 3, then sections. The ``ram``
section is the only live one here; it opens with a block list and carries page records
(``offset | flags``; flags ZERO, PAGE, EOS, CONTINUE). Everything after the ram sections is device
state, which is exactly what ``xen-save-devices-state`` writes too, so both load the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import os
import struct

from .. import linux

np = None  # numpy, for the vectorised pagemap scan: imported by warm(), off the server's start-up path


def warm() -> None:
    """Import numpy now (~0.4 s), so that the first branch's pause does not pay for it. The engine's
    ``warm_up`` calls it once the server listens; ``private_runs`` imports it when it was not, and
    falls back to a loop without it."""
    global np
    if np is None:
        try:
            import numpy
        except ImportError:  # pragma: no cover - the pure-Python loop does the same, slower
            numpy = False
        np = numpy


PAGE = 4096
QEVM_HEADER = b"QEVM\x00\x00\x00\x03"
VMDESC_STUB = b"\x06" + struct.pack(">I", 2) + b"{}"  # an empty vmdescription section
SECTION_START, SECTION_PART, SECTION_END, SECTION_FOOTER = 0x01, 0x02, 0x03, 0x7E
FLAG_ZERO, FLAG_MEM_SIZE, FLAG_PAGE, FLAG_EOS, FLAG_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
PM_PRESENT, PM_FILE = 1 << 63, 1 << 61
SEEK_DATA, SEEK_HOLE = 3, 4
TMPFS_TYPES = {"tmpfs", "shmem", "ramfs"}


class StreamError(Exception):
    """The migration stream is not one this parser understands."""


# --- files -------------------------------------------------------------------------------------

def sparse_copy(src: str, dst: str, size: int) -> int:
    """Copy ``src`` to a new ``dst`` of ``size`` bytes, skipping holes. Returns bytes copied."""
    copied = 0
    sfd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(dfd, size)
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(sfd, pos, SEEK_DATA)
                except OSError:
                    break  # no data after pos
                end = min(os.lseek(sfd, start, SEEK_HOLE), size)
                off = start
                while off < end:
                    n = os.copy_file_range(sfd, dfd, end - off, off, off)
                    if n <= 0:
                        raise OSError(f"copy_file_range stalled copying {src}")
                    off += n
                copied += end - start
                pos = end
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return copied


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest mount point prefix in mountinfo)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mnt = left.split()[4].replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, right.split()[0]
    return fstype


# --- a running VM's RAM --------------------------------------------------------------------------

def find_ram_mapping(pid: int, size: int) -> tuple[int, int, str]:
    """(start address, file offset, map_files path) of the mapping of guest RAM in QEMU ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo == size and len(parts) == 6 and parts[5].strip().startswith("/"):
                return lo, int(parts[2], 16), f"/proc/{pid}/map_files/{parts[0]}"
    raise OSError(f"no {size >> 20} MiB file mapping (guest RAM) in QEMU process {pid}")


def private_runs(pid: int, start: int, size: int) -> list[tuple[int, int]]:
    """Runs (first page, page count) of RAM pages that became private (changed) since the mapping
    was made: present in the page table and no longer the file's page."""
    npages = size // PAGE
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
        f.seek(start // PAGE * 8)
        raw = f.read(npages * 8)
    if len(raw) != npages * 8:
        raise OSError(f"short read of /proc/{pid}/pagemap")
    if np is None:
        warm()
    if np:
        v = np.frombuffer(raw, dtype=np.uint64)
        private = ((v >> np.uint64(63)) == 1) & (((v >> np.uint64(61)) & np.uint64(1)) == 0)
        edges = np.diff(np.concatenate(([0], private.view(np.int8), [0])))
        firsts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        return [(int(a), int(b - a)) for a, b in zip(firsts, ends)]
    runs: list[tuple[int, int]] = []
    first = -1
    for i, e in enumerate(memoryview(raw).cast("Q")):
        if e & PM_PRESENT and not e & PM_FILE:
            if first < 0:
                first = i
        elif first >= 0:
            runs.append((first, i - first))
            first = -1
    if first >= 0:
        runs.append((first, npages - first))
    return runs


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
IOV_MAX = 1024


def _readv_runs(pid: int, start: int, runs: list[tuple[int, int]], local: list[int]) -> int:
    """process_vm_readv each run of pages at ``start`` into the local address beside it, IOV_MAX
    runs per call; returns the bytes read, raises OSError on a short read."""
    done = 0
    for i in range(0, len(runs), IOV_MAX):
        chunk = runs[i:i + IOV_MAX]
        liov = (_IOVec * len(chunk))()
        riov = (_IOVec * len(chunk))()
        want = 0
        for j, (first, count) in enumerate(chunk):
            n = count * PAGE
            liov[j].base, liov[j].len = local[i + j], n
            riov[j].base, riov[j].len = start + first * PAGE, n
            want += n
        got = _libc.process_vm_readv(pid, liov, len(chunk), riov, len(chunk), 0)
        if got != want:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv of VM RAM: {os.strerror(err)} ({got} of {want} bytes)")
        done += want
    return done


MADV_POPULATE_WRITE = 23


class FileView:
    """A writable shared mapping of a RAM file, to read a VM's pages straight into their place."""

    def __init__(self, path: str, size: int):
        import mmap
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(self._anchor)
        self.size = size

    def populate(self, runs: list[tuple[int, int]]) -> None:
        """Fault in (allocate) the file pages of ``runs`` now, so the pause does not pay for it."""
        for first, count in runs:
            _libc.madvise(ctypes.c_void_p(self.addr + first * PAGE), ctypes.c_size_t(count * PAGE),
                          MADV_POPULATE_WRITE)

    def read_from(self, pid: int, start: int, runs: list[tuple[int, int]]) -> int:
        """Copy ``runs`` of process ``pid``'s memory at ``start`` to the same offsets of the file."""
        return _readv_runs(pid, start, runs, [self.addr + first * PAGE for first, _count in runs])

    def close(self) -> None:
        del self._anchor
        self.map.close()


# --- a write-protect left behind -----------------------------------------------------------------

UFFDIO_WRITEPROTECT = 0xC018AA06  # _IOWR(0xAA, 0x06, struct uffdio_writeprotect {start, len, mode})
UFFDIO_UNREGISTER = 0x8010AA01    # _IOR(0xAA, 0x01, struct uffdio_range {start, len})


def userfaultfds(pid: int) -> list[int]:
    """The descriptor numbers of process ``pid`` that are userfaultfds."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[userfaultfd]":
                    found.append(int(fd))
    return found


def lift_write_protect(pid: int, start: int, size: int) -> int:
    """Remove the userfaultfd write-protect of ``[start, start + size)`` in process ``pid`` and wake
    the threads waiting on it, through a copy of each of its userfaultfds (``pidfd_getfd``; the
    ioctls act on the mm the userfaultfd belongs to). Returns how many were lifted.

    For a QEMU whose live snapshot (background-snapshot) lost its stream writer: QEMU 7.2 marks the
    migration failed but never lifts the protect, and a vCPU waiting on a protected page holds the
    big lock QEMU's own clean-up and every QMP command need, so only this frees it."""
    lifted = 0
    pidfd = os.pidfd_open(pid)
    try:
        for number in userfaultfds(pid):
            try:
                fd = linux.pidfd_getfd(pidfd, number)
            except FileNotFoundError:  # QEMU closed it meanwhile: it protects nothing now
                continue
            try:
                try:
                    fcntl.ioctl(fd, UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", start, size, 0)))
                except OSError as exc:
                    # ENOENT: this userfaultfd has no write-protect registered on the range (QEMU
                    # unregistered it, or never registered RAM with it): nothing of it to lift.
                    if exc.errno in (errno.ENOENT, errno.EINVAL):
                        continue
                    raise
                with contextlib.suppress(OSError):  # QEMU may have unregistered it meanwhile
                    fcntl.ioctl(fd, UFFDIO_UNREGISTER, bytearray(struct.pack("QQ", start, size)))
                lifted += 1
            finally:
                os.close(fd)
    finally:
        os.close(pidfd)
    return lifted


def finish_device_state(path: str) -> None:
    """Append an empty vmdescription so the loader does not warn about a missing one."""
    with open(path, "ab") as f:
        f.write(VMDESC_STUB)


# --- migration streams -------------------------------------------------------------------------

class _Reader:
    def __init__(self, f: io.BufferedReader):
        self.f = f
        self.pos = 0

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise StreamError(f"migration stream ended early at byte {self.pos + len(data)}")
        self.pos += n
        return data

    def byte(self) -> int:
        return self.read(1)[0]

    def be32(self) -> int:
        return struct.unpack(">I", self.read(4))[0]

    def be64(self) -> int:
        return struct.unpack(">Q", self.read(8))[0]

    def peek(self) -> int:
        b = self.f.peek(1)[:1]
        return b[0] if b else -1

    def idstr(self) -> str:
        return self.read(self.byte()).decode()


def split_stream(stream, mem_path: str, mem_size: int, *, ignore_shared: bool = False) -> bytes:
    """Consume a migration stream: write guest RAM pages of the ``mem_size`` block into the new file
    ``mem_path`` (sparse; zero pages stay holes), return the device state (QEVM header + sections).
    """
    r = _Reader(stream)
    if r.read(8) != QEVM_HEADER:
        raise StreamError("not a QEMU migration stream (QEVM version 3)")
    fd = os.open(mem_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, mem_size)
        ram_id = None
        mem_block = None
        block = None
        run_off, run = -1, []   # consecutive pages waiting for one write

        def flush():
            nonlocal run_off, run
            if run:
                os.pwrite(fd, b"".join(run), run_off)
            run_off, run = -1, []

        while True:
            kind = r.peek()
            if kind == SECTION_START:
                r.byte()
                sid = r.be32()
                name = r.idstr()
                r.be32(), r.be32()  # instance, version
                if name != "ram":
                    raise StreamError(f"unexpected live section {name!r} before device state")
                ram_id = sid
                total = r.be64()
                if not total & FLAG_MEM_SIZE:
                    raise StreamError("ram section does not start with its block list")
                total &= ~(PAGE - 1)
                seen = 0
                while seen < total:
                    bname = r.idstr()
                    length = r.be64()
                    if ignore_shared:
                        r.be64()
                    if length == mem_size and mem_block is None:
                        mem_block = bname
                    seen += length
            elif kind in (SECTION_PART, SECTION_END):
                r.byte()
                if r.be32() != ram_id:
                    raise StreamError("a live section other than ram")
            else:
                break  # device state from here on
            # page records until EOS
            while True:
                head = r.be64()
                flags = head & (PAGE - 1)
                addr = head & ~(PAGE - 1)
                if flags & FLAG_EOS:
                    break
                if not flags & FLAG_CONTINUE:
                    block = r.idstr()
                if flags & FLAG_ZERO:
                    if r.byte() != 0:
                        raise StreamError("non-zero fill page")
                    continue
                if flags & FLAG_PAGE:
                    data = r.read(PAGE)
                    if block == mem_block:
                        if run and run_off + len(run) * PAGE == addr and len(run) < 256:
                            run.append(data)
                        else:
                            flush()
                            run_off, run = addr, [data]
                    continue
                raise StreamError(f"unsupported ram record flags {flags:#x} (compression or xbzrle?)")
            flush()
            if r.peek() == SECTION_FOOTER:
                r.read(5)
        if mem_block is None:
            raise StreamError(f"the stream has no RAM block of {mem_size} bytes")
        rest = stream.read()
        return QEVM_HEADER + rest
    finally:
        os.close(fd)
