"""A warm reserve of free huge pages, so that the first write after a branch costs a copy and no more.

A sandbox that rewrites an array it shares with a branch copies each huge page at its first write
(copy-on-write) into a new 2 MiB page. From the surplus pool alone (``hugepages.allow_surplus``) that
page comes from the buddy allocator at the fault, and on a virtual machine whose hypervisor takes
free memory back (virtio-balloon free page reporting, as on Firecracker and most clouds) a 2 MiB
block that has been free for a second or two is no longer backed by the host: the copy then waits
while the hypervisor faults in each of its 4 KiB pages. Measured here, rewriting 1 GiB right after a
fork took 1.8-6.7 s that way, 0.27-0.52 s into pages the host still backed (a memcpy of 1 GiB: 0.08 s).

So the engine keeps free pages in the kernel's persistent pool (``vm.nr_hugepages``), each written
once so that the host backs it. A free pool page is not in the buddy allocator, so it is never
reported and stays backed; a fault takes a free pool page before it makes a surplus one, and a page
freed goes back to the pool while no surplus page is in use. How many: as many as are in use on the
host (enough for each array in huge pages to be rewritten once after a branch), at most ``ceiling``
(an eighth of the machine's memory unless ``FORKD_HUGE_PAGE_RESERVE_MIB`` says otherwise; 0: no
reserve), never more than would leave less than a quarter of the memory available, and none at all
while less than an eighth is (the reserve is the first memory to go). A thread looks
once a second at low priority; it adds pages only once the pages in use have settled (a copy or a
move taking pages at that moment is never competed with), and gives back free pages past the reserve
only after ``KEEP`` seconds, so those a deleted branch freed serve the next copy. A pool page is
charged to no one until a sandbox faults it, then to that sandbox's huge-page cap as any other page:
limits and isolation are as they were.

The pool is the host's, so every engine on it follows this same rule on the same figures
(``/proc/meminfo``) under one lock (give every server on a host the same ceiling, or the reserve
swings between theirs every ``KEEP`` seconds), and the last engine to close empties the reserve
(``vm.nr_hugepages`` back to 0). An engine killed outright leaves it as it was until the next one
takes it over. A pool an administrator set up (``vm.nr_hugepages`` neither 0 nor the figure forkd last
wrote) is left alone: then there is no reserve.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time

from .hugepages import HUGE, Destination

LOCK = "/run/forkd-huge-pages"                 # held to change the pool; holds the figures forkd wrote
ENGINES = "/run/forkd-huge-pages.engines"      # every engine holds a shared lock on it while it runs
POOL = "/proc/sys/vm/nr_hugepages"
TICK = 1.0       # s between looks at the pool
SLACK = 32       # free pages past the reserve (and at least a quarter of it) before any is given back
KEEP = 30.0      # s free pages stay past the slack before they are given back
SETTLED = 16     # pages in use may change by this much in a tick and count as settled


def meminfo() -> dict[str, int]:
    """/proc/meminfo's numbers: kB, or pages for the HugePages_ lines."""
    with open("/proc/meminfo") as f:
        return {key: int(rest.split()[0]) for key, _, rest in (line.partition(":") for line in f) if rest.strip()}


def _pool() -> int:
    with open(POOL) as f:
        return int(f.read())


def _figures(text: str) -> set[int]:
    """The figures of the pool forkd recorded (``LOCK``'s text): what it set, or what it was setting."""
    return {int(word) for word in text.split() if word.isdigit()}


def ceiling_pages() -> int:
    """The most pages the reserve holds: ``FORKD_HUGE_PAGE_RESERVE_MIB``, else an eighth of memory."""
    mib = os.environ.get("FORKD_HUGE_PAGE_RESERVE_MIB")
    if mib is None:
        return meminfo()["MemTotal"] * 1024 // 8 // HUGE
    if not mib.strip().isdigit():
        raise ValueError(f"FORKD_HUGE_PAGE_RESERVE_MIB must be a whole number of MiB (0: no warm reserve of huge "
                         f"pages), not {mib!r}")
    return int(mib) * (1 << 20) // HUGE


def _want_have(info: dict[str, int], ceiling: int) -> tuple[int, int]:
    """(free pages the reserve wants: as many as are in use, up to ``ceiling``; free pages it has:
    those no mapping has reserved)."""
    free = info["HugePages_Free"]
    return min(info["HugePages_Total"] - free, ceiling), free - info["HugePages_Rsvd"]


def plan(info: dict[str, int], ceiling: int, settled: bool, over_for: float) -> int:
    """Pages to add to the pool (negative: to give back) so that its free pages cover the pages in
    use, up to ``ceiling``, while a quarter of the memory stays available (under an eighth, the
    reserve goes first). It grows only once the pages in use have ``settled`` (a copy or a move
    taking pages now is never competed with) and gives back only what has been past the slack for
    ``KEEP`` s (``over_for``), so that pages a deleted branch frees serve the next copy."""
    want, have = _want_have(info, ceiling)
    short = (info["MemTotal"] // 8 - info["MemAvailable"]) * 1024 // HUGE
    if short > 0 and have > 0:
        return -min(have, short)
    if have < want and settled:
        room = (info["MemAvailable"] - info["MemTotal"] // 4) * 1024 // HUGE
        return max(0, min(want - have, room))
    if over(info, ceiling) and over_for >= KEEP:
        return want - have
    return 0


def over(info: dict[str, int], ceiling: int) -> bool:
    """Whether the free pages are past the reserve by more than the slack."""
    want, have = _want_have(info, ceiling)
    return have > want + max(SLACK, want // 4)


def warm(pages: int, stop) -> None:
    """Write ``pages`` free pool pages once (the kernel zeroes each at its fault), so that the host
    backs them, and free them back to the pool, which hands out its latest pages first: those just
    added. Stops early once ``stop()``, or where no page is left to take."""
    with contextlib.suppress(OSError):
        dest = Destination(pages * HUGE)  # left out of any fork the server makes meanwhile
        try:
            dest.fill(stop)
        except OSError:
            pass  # the pool ran dry (others took pages meanwhile): what was written stays written
        finally:
            dest.close()


def describe() -> str:
    """The host's reserve as it stands, in a sentence (``forkd doctor``)."""
    try:
        pool, info = _pool(), meminfo()
    except OSError as exc:
        return f"no hugetlb pool to keep a warm reserve in: {exc}"
    try:
        with open(LOCK) as f:
            ours = _figures(f.read())
    except OSError:
        ours = set()  # no engine has kept one on this host yet
    if pool and pool not in ours:
        return f"vm.nr_hugepages={pool} is the host's own pool: no warm reserve, forkd leaves it as it is"
    try:
        ceiling_mib = ceiling_pages() * HUGE >> 20
    except ValueError as exc:
        return str(exc)
    if not ceiling_mib:
        return "no warm reserve of huge pages (FORKD_HUGE_PAGE_RESERVE_MIB=0): a write after a branch may wait for the host"
    free_mib = (info["HugePages_Free"] - info["HugePages_Rsvd"]) * HUGE >> 20
    return (f"warm reserve: {free_mib} MiB of free huge pages now, kept while a server runs (as many as are in use, "
            f"at most {ceiling_mib} MiB: FORKD_HUGE_PAGE_RESERVE_MIB)")


def start() -> HugePageReserve | None:
    """The reserve, kept while the engine runs; None where it is set to 0, or where the host has no
    /run to share it in (the copies then come as they come). ValueError for a bad setting."""
    if not ceiling_pages():
        return None
    try:
        return HugePageReserve()
    except OSError:
        return None


class HugePageReserve:
    """Keeps the host's reserve of warm free huge pages while this engine runs (``close`` to stop)."""

    def __init__(self) -> None:
        self.ceiling = ceiling_pages()
        self.note = ""
        self._stop = threading.Event()
        self._in_use: int | None = None     # pages in use at the last look
        self._over_since: float | None = None  # since when the free pages are past the slack
        self._engines = open(ENGINES, "a")  # noqa: SIM115 - held (and share-locked) until close
        fcntl.flock(self._engines, fcntl.LOCK_SH)
        self._thread = threading.Thread(target=self._run, name="forkd-huge-page-reserve", daemon=True)
        self._thread.start()

    @staticmethod
    @contextlib.contextmanager
    def _locked(wait: bool):
        """The pool's lock and the figures of the pool forkd may have left (None: the lock is busy
        and not waited for)."""
        with open(LOCK, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield None, None
                return
            f.seek(0)
            yield f, _figures(f.read())

    @staticmethod
    def _write(f, pages: int) -> None:
        """Set the pool, recording the figures first: an engine killed between the two leaves a
        pool the next one still knows for forkd's."""
        def record(text: str) -> None:
            f.seek(0)
            f.truncate()
            f.write(text)
            f.flush()
        record(f"{_pool()} {pages}")
        with open(POOL, "w") as pool:
            pool.write(str(pages))
        record(str(_pool()))  # the kernel may have made fewer than asked

    def step(self) -> int:
        """One look at the pool: resize it to plan, and warm what was added. Returns the pages added
        (negative: given back)."""
        with self._locked(wait=False) as (f, ours):
            if f is None:
                return 0  # another engine is at it
            before = _pool()
            if before and before not in ours:
                self.note = (f"the host's own pool of {before} huge pages (vm.nr_hugepages) is kept: no warm reserve, "
                             f"so a write after a branch may wait for the host to back its copies")
                return 0
            info = meminfo()
            in_use = info["HugePages_Total"] - info["HugePages_Free"]
            settled = self._in_use is not None and abs(in_use - self._in_use) <= SETTLED
            self._in_use = in_use
            now = time.monotonic()
            self._over_since = (self._over_since or now) if over(info, self.ceiling) else None
            change = plan(info, self.ceiling, settled, now - (self._over_since or now))
            if change == 0:
                return 0
            if change > 0:
                target = info["HugePages_Total"] + change  # surplus pages in use turn persistent first
            else:
                target = before + change
            self._write(f, max(0, target))
            added = meminfo()["HugePages_Total"] - info["HugePages_Total"]
            if added > 0:
                warm(added, self._stop.is_set)  # under the lock: the pages it holds meanwhile are not "in use"
            return added

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # behind the sandboxes' work, never in front of it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        while not self._stop.wait(TICK):
            try:
                self.step()
            except (OSError, ValueError, KeyError) as exc:
                self.note = f"the warm reserve of huge pages stopped: {exc}"
                return

    def close(self) -> None:
        """Stop; the last engine on the host empties the reserve (and the pool forkd made)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._engines.close()
        with open(ENGINES, "a") as engines:
            try:
                fcntl.flock(engines, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another engine runs on: it keeps the reserve
            with self._locked(wait=True) as (f, ours), contextlib.suppress(OSError):
                if _pool() in ours - {0}:
                    # the free pages go back to the host; those in use turn surplus, as many as the
                    # surplus ceiling allows (past it, a sandbox's next fault would find none)
                    info = meminfo()
                    with open("/proc/sys/vm/nr_overcommit_hugepages") as ceiling:
                        room = int(ceiling.read()) - info["HugePages_Surp"]
                    self._write(f, max(0, info["HugePages_Total"] - info["HugePages_Free"] - room))
