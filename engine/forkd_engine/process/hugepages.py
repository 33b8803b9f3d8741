"""Big buffers in huge pages that copy-on-write never splits (hugetlb), so that a branch made right
after a cell rewrote them still pauses for a millisecond or two.

A cell that rewrites memory shared with an earlier branch splits its transparent huge pages: the
kernel copies a shared THP 4 KiB at a time, and the next fork copies 512 times as many page-table
entries (20-45 ms per GiB here, instead of ~1 ms). A hugetlb page is copied whole on write and is
never split, so a fork of a GiB of them copies 512 entries whatever the cells did since.

What moves: a NumPy array of at least ``MIN_BUFFER`` reachable from the sandbox's namespace that
owns its data in glibc's own mapping (malloc's "mmapped chunk", whose header is checked), with
every page present (nothing is allocated for memory never touched) and this process's alone (not
shared with a snapshot, where moving would cost a second copy). Its 2 MiB-aligned interior is
copied, ``PIECE`` at a time, into a private ``MAP_HUGETLB | MAP_NORESERVE`` mapping that then
replaces those pages in place (``mremap``). The array, its address and its values are unchanged;
glibc's ``free()`` unmaps the whole chunk as before, and ``realloc()`` (whose ``mremap`` refuses a
range that is now several mappings) falls back to malloc, copy and free.

Exactness: the copy and the replacement run on the sandbox's main thread as one job of its
executor (``move``), so no cell runs meanwhile; the job holds the array (it cannot be freed),
finds no user thread alive, and holds signals back and the garbage collector off, so nothing can
write to the memory between the copy and the replacement. The huge pages are filled before, on the
background thread, which costs the main thread nothing; a fork meanwhile does not copy them
(``MADV_DONTFORK`` until they are in place).

The pages come from the kernel's surplus pool on demand (``vm.nr_overcommit_hugepages``, which
``allow_surplus`` raises from 0 when the engine starts) and go back to it when the array is freed,
or from the warm reserve the engine keeps in the persistent pool for copy-on-write (``reserve.py``).
``MAP_NORESERVE`` reserves nothing, so no page is ever taken back from a fork (a private hugetlb
mapping holding a reservation takes its pages back from its forks, which then die with SIGBUS, when
the pool runs dry); if the host cannot supply a huge page for a later copy-on-write, the process
writing gets SIGBUS, as it would meet the OOM killer with 4 KiB pages.

Hugetlb pages are not charged to a memory cgroup, so each sandbox's leaf caps them apart, at its
memory limit (``cgroups.py``); the compactor moves no more than that, and a piece the cap refuses
stays in ordinary pages. Where the host cannot cap them, no pool is raised and no sandbox moves any.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import mmap
import os
import signal
import sys
import types
import weakref

HUGE = 2 << 20
MIN_BUFFER = 32 << 20  # smaller arrays stay in transparent huge pages (and the compactor's care)
PIECE = 16 << 20       # moved per job: ~2 ms of copying on the main thread
_PAGE = mmap.PAGESIZE
_HEADER = 2 * ctypes.sizeof(ctypes.c_size_t)  # glibc's chunk header before the memory malloc returns
_IS_MMAPPED = 0x2
MAP_HUGETLB, MAP_NORESERVE = 0x40000, 0x4000
MADV_DONTFORK, MADV_DOFORK, MADV_POPULATE_WRITE = 10, 11, 23
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
MAP_FIXED = 0x10
# VmFlags a mapping may carry and still be moved: read, write, may read/write/exec, accounted,
# soft-dirty, THP advice, KSM. Anything else (locked, don't-fork, wipe-on-fork, userfaultfd...) stays.
_PLAIN_FLAGS = frozenset({"rd", "wr", "mr", "mw", "me", "ac", "sd", "hg", "nh", "mg"})
_SKIP = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.CodeType, types.FrameType, str, bytes, int, float)
WALK_LIMIT = 20000  # objects looked at when finding the namespace's arrays

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.memcpy.restype = ctypes.c_void_p
_libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


# --- the host side ------------------------------------------------------------------------------

def allow_surplus(capped: tuple[bool, str]) -> tuple[bool, str]:
    """(usable, why): let the kernel make 2 MiB huge pages on demand, as the engine starts (root).

    Only where each sandbox's huge pages are capped (``capped``: ``Cgroups.hugetlb_status()``):
    hugetlb pages are not charged to a memory cgroup, so elsewhere a pool would let any sandbox's
    ``MAP_HUGETLB`` take memory past its limit. There the settings are kept as found, no sandbox
    gets huge pages, and the sandboxes' seccomp filter refuses them.

    Raises ``vm.nr_overcommit_hugepages`` from 0 to the machine's memory in huge pages: a ceiling,
    not a reservation (nothing is allocated until a sandbox asks, and freed pages go back). A
    setting an administrator made (either knob non-zero) is left as it is. ``FORKD_HUGE_PAGES=0``
    keeps sandboxes off huge pages altogether."""
    enforced, why_capped = capped
    if not enforced:
        return False, f"{why_capped}: vm.nr_overcommit_hugepages is kept as found and no sandbox gets huge pages"
    if os.environ.get("FORKD_HUGE_PAGES", "1") == "0":
        return False, "FORKD_HUGE_PAGES=0"
    try:
        with open("/proc/meminfo") as f:
            info = {k: v.split()[0] for k, _, v in (line.partition(":") for line in f)}
        if info.get("Hugepagesize") != str(HUGE >> 10):
            return False, f"the default huge page size is {info.get('Hugepagesize')} kB, not {HUGE >> 10} kB"
        with open("/proc/sys/vm/nr_overcommit_hugepages") as f:
            surplus = int(f.read())
        with open("/proc/sys/vm/nr_hugepages") as f:
            static = int(f.read())
        if surplus or static:
            return True, f"the host allows {surplus} surplus and has {static} static huge pages; {why_capped}"
        ceiling = int(info["MemTotal"]) * 1024 // HUGE
        with open("/proc/sys/vm/nr_overcommit_hugepages", "w") as f:
            f.write(str(ceiling))
        return True, f"vm.nr_overcommit_hugepages raised from 0 to {ceiling}; {why_capped}"
    except (OSError, KeyError, ValueError) as exc:
        return False, f"no hugetlb pool: {exc}"


# --- finding what to move (the sandbox's main thread) -----------------------------------------

class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]


def _read(addr: int, size: int) -> bytes | None:
    """Our own memory, read by the kernel: None where it is not mapped (never a crash)."""
    buf = ctypes.create_string_buffer(size)
    local, remote = _IOVec(ctypes.addressof(buf), size), _IOVec(addr, size)
    got = _libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return buf.raw if got == size else None


def _chunk(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """glibc's mmapped chunk holding [ptr, ptr+nbytes), as (start, end); None if it is not one."""
    head = _read(ptr - _HEADER, _HEADER)
    if head is None or len(head) != _HEADER:
        return None
    prev_size, size = int.from_bytes(head[:_HEADER // 2], sys.byteorder), int.from_bytes(head[_HEADER // 2:], sys.byteorder)
    start, total = ptr - _HEADER, size & ~0x7
    if prev_size or size & 0x7 != _IS_MMAPPED or start % _PAGE or total % _PAGE or start + total < ptr + nbytes:
        return None
    return start, start + total


def find_buffers(namespace: dict) -> list[tuple[weakref.ref, int, int, int, int]]:
    """(array, data pointer, nbytes, lo, hi) of the big arrays the namespace reaches, biggest
    first, whose 2 MiB-aligned interior [lo, hi) could move. Runs on the main thread (a job)."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return []
    ndarray = numpy.ndarray
    seen: set[int] = set()
    found: dict[int, tuple] = {}
    todo = list(namespace.values())
    looked = 0
    while todo and looked < WALK_LIMIT:
        obj = todo.pop()
        kind = type(obj)  # never isinstance: a proxy's __class__ could run user code
        if id(obj) in seen or issubclass(kind, _SKIP):
            continue
        seen.add(id(obj))
        looked += 1
        if issubclass(kind, ndarray):
            owner = obj
            while issubclass(type(ndarray.base.__get__(owner)), ndarray):
                owner = ndarray.base.__get__(owner)
            flags = ndarray.flags.__get__(owner)
            nbytes = ndarray.nbytes.__get__(owner)
            if id(owner) in found or not flags.owndata or nbytes < MIN_BUFFER:
                continue
            ptr = ndarray.__array_interface__.__get__(owner)["data"][0]
            chunk = _chunk(ptr, nbytes)
            if chunk is None:
                continue
            lo, hi = -(-chunk[0] // HUGE) * HUGE, chunk[1] // HUGE * HUGE
            if hi - lo >= HUGE:
                found[id(owner)] = (weakref.ref(owner), ptr, nbytes, lo, hi)
        else:
            todo.extend(gc.get_referents(obj))
    return sorted(found.values(), key=lambda b: b[4] - b[3], reverse=True)


# --- where the pieces stand (any thread: kernel interfaces only) -------------------------------

def _mappings() -> list[tuple[int, int, bool]]:
    """(lo, hi, movable) for every mapping. Movable: private anonymous read-write memory with
    ordinary flags, all of it resident and mapped by this process alone (not shared with a branch,
    where moving would cost a second copy; never touched, where it would allocate memory)."""
    out = []
    with open("/proc/self/smaps") as f:
        current: dict | None = None
        for line in f:
            head = line.split(maxsplit=6)
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = {"lo": lo, "hi": hi, "ok": head[1] == "rw-p" and head[4] == "0" and len(head) == 5}
                out.append(current)
            elif current is None:
                continue
            elif head[0] == "Rss:":
                current["ok"] &= int(head[1]) * 1024 == current["hi"] - current["lo"]
            elif head[0] in ("Shared_Clean:", "Shared_Dirty:", "Swap:"):
                current["ok"] &= head[1] == "0"
            elif head[0] == "VmFlags:":
                current["ok"] &= set(line.split()[1:]) <= _PLAIN_FLAGS
    return [(m["lo"], m["hi"], m["ok"]) for m in out]


def pieces(lo: int, hi: int) -> list[tuple[int, int]]:
    """(start, size) of the pieces of [lo, hi) that can move now (see ``_mappings``; a piece moved
    already is a hugetlb mapping), none when the process nears its limit of mappings."""
    maps = _mappings()
    with open("/proc/sys/vm/max_map_count") as f:
        if len(maps) + 2 * (hi - lo) // PIECE > int(f.read()) // 2:  # every move can add two
            return []
    movable = [(a, b) for a, b, ok in maps if ok and b > lo and a < hi]
    out = []
    for start in range(lo, hi, PIECE):
        end = min(start + PIECE, hi)
        if _covered(movable, start, end):
            out.append((start, end - start))
    return out


def _covered(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``ranges`` (in address order) cover [start, end) without a gap (neighbours may be
    listed apart)."""
    cursor = start
    for a, b in ranges:
        if a <= cursor < b:
            cursor = b
    return cursor >= end


class Destination:
    """Huge pages for one piece, filled before the move, left out of forks until then."""

    def __init__(self, size: int):
        self.size = size
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB | MAP_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise _errno_error("mmap of huge pages")
        self.addr: int | None = addr
        if _libc.madvise(addr, size, MADV_DONTFORK):
            self.close()
            raise _errno_error("madvise(MADV_DONTFORK)")

    def fill(self, stop) -> bool:
        """Allocate the pages, 2 MiB at a time; False once ``stop()`` (a fork wants the memory map).
        OSError when the host has no huge page to give."""
        for off in range(0, self.size, HUGE):
            if stop():
                return False
            if _libc.madvise(self.addr + off, HUGE, MADV_POPULATE_WRITE):
                raise _errno_error("no huge page to allocate (MADV_POPULATE_WRITE)")
        return True

    def close(self) -> None:
        if self.addr is not None:
            _libc.munmap(self.addr, self.size)
            self.addr = None


# --- the move (the sandbox's main thread, as one job) ------------------------------------------

def _mapped(start: int, size: int) -> bool:
    return _covered([(a, b) for a, b, _ in _mappings()], start, start + size)


@contextlib.contextmanager
def _quiet():
    """No signal handler and no garbage collection (with its finalizers) on any thread meanwhile."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def move(dest: Destination, array_ref: weakref.ref, ptr: int, nbytes: int, start: int, size: int) -> bool:
    """Copy the piece into ``dest`` and put ``dest`` in its place. True when moved. The caller
    makes sure nothing ran since ``pieces`` found the piece movable (no job between)."""
    from ..agent.inventory import other_threads  # noqa: PLC0415 - the agent's, in the sandbox only

    array = array_ref()
    if array is None or other_threads():
        return False
    numpy = sys.modules["numpy"]
    if (numpy.ndarray.__array_interface__.__get__(array)["data"][0] != ptr
            or numpy.ndarray.nbytes.__get__(array) != nbytes):
        return False  # resized since
    with _quiet():
        _libc.memcpy(dest.addr, start, size)
        if _libc.madvise(dest.addr, size, MADV_DOFORK):
            return False
        moved = _libc.mremap(dest.addr, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, start)
        if moved == start:
            dest.addr = None  # it is the array's now
            return True
        if not _mapped(start, size):  # the failed call had already unmapped the piece: put it back
            back = _libc.mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED, -1, 0)
            if back != start:
                os.abort()  # the array's memory is gone: dying loudly beats a wrong value
            _libc.memcpy(start, dest.addr, size)
        return False
