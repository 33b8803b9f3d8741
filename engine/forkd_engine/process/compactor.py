"""Keep a sandbox's memory in huge pages while it is idle, so a live branch pauses for milliseconds.

A cell that rewrites memory shared with an earlier branch splits every huge page it touches into
4 KiB pages (copy-on-write), and a fork then copies 512 times as many page-table entries. A live
branch collapses them back first (``MADV_COLLAPSE``), which for a gigabyte takes seconds; done
here, on a low-priority thread as soon as the cell ends, that work is off the branch's path: by
the time the notebook's next ``%forkd branch --live`` arrives it is done, or nearly.
"""

from __future__ import annotations

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
        self.lock = threading.Lock()  # held while collapsing: a live branch waits, then has little left
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="forkd-compact", daemon=True).start()

    def poke(self) -> None:
        """A cell ended: compact when there is enough to gain."""
        self._wake.set()

    def collapse(self) -> None:
        with self.lock:
            linux.collapse_anonymous_memory()

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
                    self.collapse()
            except OSError:
                pass
