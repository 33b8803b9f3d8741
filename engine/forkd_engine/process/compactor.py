"""Keep a sandbox's memory in huge pages while it is idle, so a live branch pauses for milliseconds.

A cell that rewrites memory shared with an earlier branch splits every huge page it touches into
4 KiB pages (copy-on-write), and a fork then copies 512 times as many page-table entries. Putting
them back into huge pages (``MADV_COLLAPSE``) takes seconds for a gigabyte, so it is done here, on a
low-priority thread as soon as the cell ends: by the time the notebook's next ``%forkd branch
--live`` arrives it is done, or nearly. A branch never waits for it: it stops the pass at its next
2 MiB step and forks; what is left costs the fork's pause (about 30 ms per split GiB here) instead
of seconds of the call, and the pass goes on once the sandbox is idle again.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .. import linux

SPLIT_THRESHOLD_KIB = 64 * 1024  # below this much 4 KiB anonymous memory, a fork is fast anyway


def split_anonymous_kib() -> int:
    """Private anonymous memory not in huge pages (what makes a fork slow), in KiB."""
    anon = huge = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key == "Anonymous":
                anon = int(rest.split()[0])
            elif key == "AnonHugePages":
                huge = int(rest.split()[0])
    return max(0, anon - huge)


class Compactor:
    def __init__(self):
        self.lock = threading.Lock()  # held while collapsing
        self._wake = threading.Event()
        self._yield = threading.Event()  # a branch wants the lock: the background pass stops
        threading.Thread(target=self._run, name="forkd-compact", daemon=True).start()

    def poke(self) -> None:
        """A cell ended: compact when there is enough to gain."""
        self._wake.set()

    @contextlib.contextmanager
    def stopped(self):
        """The background pass stopped (at its next 2 MiB step) and kept from starting: a fork
        under way never competes with it for the page tables. It goes on when poked."""
        self._yield.set()
        with self.lock:
            self._yield.clear()
            yield

    def _run(self) -> None:
        try:  # behind the user's next cell, never in front of it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        except OSError:
            pass
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                if split_anonymous_kib() >= SPLIT_THRESHOLD_KIB:
                    with self.lock:
                        linux.collapse_anonymous_memory(stop=self._yield.is_set)
            except OSError:
                pass
