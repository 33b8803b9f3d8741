"""Keep a sandbox's memory cheap to fork while it is idle, so a live branch pauses for milliseconds.

A cell that rewrites memory shared with an earlier branch splits every transparent huge page it
touches into 4 KiB pages (copy-on-write), and a fork then copies 512 times as many page-table
entries. Two remedies, run on a low-priority thread once the sandbox has been idle for ``SETTLE``:

1. Big NumPy arrays move into hugetlb pages (``hugepages.py``), which copy-on-write never splits:
   once moved, a branch right after a cell rewrote them forks as fast as one after an idle pause.
   Done once per array, where the host caps each sandbox's huge pages (at its memory limit): no
   more than the cap moves, and what the cap refuses stays in ordinary memory, exact.
2. What stays in ordinary memory is put back into huge pages (``MADV_COLLAPSE``), which takes
   seconds for a gigabyte, hence in the background, after each cell that split some.

A branch never waits for either: it stops the pass at its next 2 MiB step and forks; the pass
goes on once the sandbox is idle again.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .. import linux
from ..agent.executor import Busy
from . import hugepages

SPLIT_THRESHOLD_KIB = 64 * 1024  # below this much 4 KiB anonymous memory, a fork is fast anyway
SETTLE = 0.05  # s of idleness before the pass starts: never between two cells sent back to back


def split_anonymous_kib() -> int:
    """Private anonymous memory not in huge pages (what makes a fork slow), in KiB."""
    rollup = linux.smaps_rollup()
    return max(0, rollup.get("Anonymous", 0) - rollup.get("AnonHugePages", 0))


def hugetlb_kib() -> int:
    """Memory this process holds in hugetlb pages (moved buffers), in KiB."""
    rollup = linux.smaps_rollup()
    return rollup.get("Private_Hugetlb", 0) + rollup.get("Shared_Hugetlb", 0)


class Compactor:
    def __init__(self, executor, namespace: dict, huge_pages_mib: int = 0):
        self.executor = executor      # the sandbox's main thread: moves run there, between cells
        self.namespace = namespace    # where the big arrays are found
        self.huge_pages_cap = huge_pages_mib << 20  # the sandbox's huge-page cap (its memory limit; 0: none may move)
        self.lock = threading.Lock()  # held while a step touches the memory map
        self._wake = threading.Event()
        self._yield = threading.Event()  # a branch wants the lock: the background pass stops
        self._thread: threading.Thread | None = None  # started by the first poke: a fresh sandbox has
        self._start_lock = threading.Lock()           # nothing to compact, and a thread costs memory

    def poke(self) -> None:
        """User code ran: look again once the sandbox is idle."""
        self._wake.set()
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="forkd-compact", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # the sandbox is at its pids limit: the next poke tries again
                    return
                self._thread = thread

    @contextlib.contextmanager
    def stopped(self):
        """The background pass stopped (at its next 2 MiB step) and kept from starting: a fork
        under way never competes with it for the page tables. It goes on when poked."""
        self._yield.set()
        with self.lock:
            self._yield.clear()
            yield

    def _idle(self) -> bool:
        return self.executor.busy() is None and self.executor.jobs.empty()

    def _run(self) -> None:
        try:  # behind the user's next cell, never in front of it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        except OSError:
            pass
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._wake.wait(SETTLE) or not self._idle():
                continue  # more is running: its end pokes again
            try:
                if self.huge_pages_cap:
                    self._move_buffers()
                if split_anonymous_kib() >= SPLIT_THRESHOLD_KIB:
                    with self.lock:
                        linux.collapse_anonymous_memory(stop=self._yield.is_set)
            except Exception:  # noqa: BLE001 - best effort: the thread lives on, the next pass retries
                pass

    def _stop(self) -> bool:
        return self._yield.is_set() or not self._idle()

    def _move_buffers(self) -> None:
        """Move the namespace's big arrays into hugetlb pages, a piece per main-thread job."""
        try:
            buffers = self.executor.call(lambda: hugepages.find_buffers(self.namespace),
                                         "finding big arrays", user_code=False, start_within=SETTLE)
        except Busy:
            return
        for ref, ptr, nbytes, lo, hi in buffers:
            seen = self.executor.started
            if self._stop():
                return
            for start, size in hugepages.pieces(lo, hi):
                if hugetlb_kib() * 1024 + size > self.huge_pages_cap:
                    continue  # past the cap: this piece stays in ordinary memory (a smaller one may fit)
                with self.lock:
                    if self._yield.is_set():
                        return
                    dest = hugepages.Destination(size)  # OSError: no huge pages here
                    try:
                        filled = dest.fill(self._yield.is_set)
                    except OSError:
                        # The host's pool, or the cap counting pages we no longer see (held by a
                        # branch since a rewrite): the rest stays where it is; the next pass retries.
                        dest.close()
                        return
                if not filled:
                    dest.close()
                    return

                def move_if_unchanged(seen=seen, dest=dest, start=start, size=size):
                    # no job between the scan and this one (a cell, or a branch sharing the pages)
                    return self.executor.started == seen + 1 and hugepages.move(dest, ref, ptr, nbytes, start, size)

                try:
                    moved = self.executor.call(move_if_unchanged, "moving an array into huge pages",
                                               user_code=False, start_within=SETTLE)
                except Busy:
                    return
                finally:
                    dest.close()  # a no-op once moved
                if not moved:
                    return  # something ran meanwhile: the next pass looks again
                seen += 1
