"""An idle notebook holds no CPU, then no RAM: HEAD moves down the tiers while the notebook idles
(frozen after ``freeze_after`` seconds, stored after ``store_after`` on the VM engine), and the next
request wakes it first; a cell that woke it says how long the wake took, in one line.

One thread waits for the next deadline; a lock orders its moves against the wakes, so a cell never
finds HEAD half moved. A request in flight (a cell, a completion) holds the moves off, and the
server refuses a move down while HEAD's main thread runs something (409), which leaves it running.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

RETRY_AFTER = 60.0  # s before a move that failed is tried again
STORE_ENGINES = ("vm",)  # a process sandbox cannot be written as files: frozen is its deepest tier


class IdleTiers:
    def __init__(self, controller, head, freeze_after: float, store_after: float,
                 log: Callable[[str], None] = lambda text: None):
        self.controller, self.head, self.log = controller, head, log
        self.freeze_after, self.store_after = freeze_after, store_after
        self.tier = "running"        # HEAD's tier as this kernel moved it
        self.sandbox: str | None = None  # the HEAD that tier is about
        self._last = time.monotonic()
        self._busy = 0
        self._retry_at = 0.0  # after a move that failed, none before this (monotonic)
        self._lock = threading.RLock()
        self._changed = threading.Condition(threading.Lock())
        self._stop = False
        if freeze_after > 0 or store_after > 0:
            threading.Thread(target=self._run, name="forkd-idle-tiers", daemon=True).start()

    # --- the requests: each wakes HEAD first ------------------------------------------------------

    def begin(self) -> None:
        with self._changed:
            self._busy += 1
            self._changed.notify_all()

    def end(self) -> None:
        with self._changed:
            self._busy -= 1
            self._last = time.monotonic()
            self._changed.notify_all()

    def awake(self) -> str | None:
        """HEAD running again if this kernel moved it down; the line saying how long that took (None
        when nothing was to wake)."""
        with self._lock:
            if self.tier == "running" or self.sandbox != self.head.sandbox_id:
                return None
            was, sandbox = self.tier, self.sandbox
            t0 = time.perf_counter()
            woke = self.controller.wake_sandbox(sandbox).get("wake") or {}
            if self.head.ended is not None or was == "stored":  # its QEMU ended with its session
                self.head.attach(sandbox)
            self.head.parked = False
            self.tier = "running"
            seconds = time.perf_counter() - t0
        with self._changed:
            self._last = time.monotonic()
        if woke.get("from") == "running":  # a move that failed left it running: nothing to say
            return None
        line = f"forkd: woke this notebook's sandbox {sandbox} from {woke.get('from', was)} in {seconds:.2f} s"
        if woke.get("from") == "stored":
            line += (f" (fetch {woke['fetch_ms'] / 1000:.2f} s, decompress {woke['decompress_ms'] / 1000:.2f} s, "
                     f"restore {woke['restore_ms'] / 1000:.2f} s)")
        return line

    def close(self) -> None:
        with self._changed:
            self._stop = True
            self._changed.notify_all()

    # --- the moves down ---------------------------------------------------------------------------

    def _next(self) -> tuple[str, float] | None:
        """(the next move, seconds until it is due) from the current state, or None for none."""
        now = time.monotonic()
        idle, wait = now - self._last, self._retry_at - now
        moves = []
        if self.tier == "running" and self.freeze_after > 0:
            moves.append(("freeze", self.freeze_after - idle))
        if self.tier in ("running", "frozen") and self.store_after > 0:
            moves.append(("store", self.store_after - idle))  # straight from running if it comes first
        if not moves:
            return None
        move, due = min(moves, key=lambda m: m[1])
        return move, max(due, wait)

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    if self._stop:
                        return
                    if self.sandbox != self.head.sandbox_id:  # HEAD moved (checkout): it runs
                        self.sandbox, self.tier = self.head.sandbox_id, "running"
                    due = None if self._busy or self.head.sandbox_id is None else self._next()
                    if due is not None and due[1] <= 0:
                        break
                    self._changed.wait(None if due is None else due[1])
            self._move(due[0])

    def _move(self, move: str) -> None:
        with self._lock:
            with self._changed:
                if self._busy or self._next() is None or self._next()[0] != move or self._next()[1] > 0:
                    return  # a request came in meanwhile
            sandbox = self.head.sandbox_id
            try:
                if move == "freeze":
                    self.controller.freeze_sandbox(sandbox)
                    self.tier = "frozen"
                elif self.controller.get_sandbox(sandbox).get("engine") in STORE_ENGINES:
                    self.head.parked = True  # its session ends with its QEMU: no death to report
                    try:
                        self.controller.store_sandbox(sandbox)
                    except BaseException:
                        self.head.parked = False
                        raise
                    self.tier = "stored"
                else:
                    self.store_after = 0  # frozen is the deepest tier there: stay frozen
            except Exception as exc:  # noqa: BLE001 - a busy HEAD (409) or a server away: try again later
                self.log(f"forkd: could not {move} this notebook's sandbox {sandbox}: {exc}")
                self._retry_at = time.monotonic() + RETRY_AFTER
                try:  # a store that failed leaves it running (the server thawed it for the branch)
                    self.tier = self.controller.get_sandbox(sandbox).get("tier") or self.tier
                except Exception:  # noqa: BLE001 - the server is away: the next request says so
                    pass
            finally:
                with self._changed:
                    self._last = time.monotonic() if self.tier == "running" else self._last
                    self._changed.notify_all()
