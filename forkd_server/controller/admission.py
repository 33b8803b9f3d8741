"""Admission: which call runs now, on which threads, and which is refused (and how to go on).

Every controller call blocks (it forks processes, talks to sockets), so each runs on a thread. Two
pools keep long work from starving control:

- **control** calls (list, get, kill, ping, interrupt, inventory, memory, tree, metrics, snapshot
  and workspace reads and deletes) are short and bounded; they run on a pool of their own
  (``control_workers``) that long work never touches, so a kill is never queued behind the work
  it is meant to stop.
- **long** calls (exec, eval, run, files, branch, spawn, snapshot create, compact, workspace
  create/suspend/resume) run on a pool of ``max_long_calls`` threads after three checks, all made
  on the event loop (one thread: no locks):

  1. the server's cap: at most ``max_long_calls`` long calls at once, waiting ones included (503
     past it), so an admitted call never waits for a thread;
  2. the caller's cap: at most ``max_long_calls_per_caller`` per caller (429 past it); a caller is
     the token a request carries (by its hash), else the user of a cookie login, and within it
     the client its ``X-Forkd-Client`` header names (``handlers.base.caller_of``);
  3. the sandbox's lane, for calls that run user code in a sandbox (exec, eval, run): one at a
     time per sandbox; up to ``sandbox_queue_size`` more wait their turn in order, each at most
     ``sandbox_queue_timeout`` seconds (409 busy past either, saying what runs and what to do).
     Files and branch stay outside the lane: reading a file a cell writes, or a lossy branch of a
     sandbox mid-cell, must work while the cell runs.

  An admitted eval or exec of a running process sandbox is made on the event loop rather than a
  thread (``on_loop``, loop_calls.py): the checks, caps and lane are the same.

``GET /healthz``'s capacity figures (file reads and the registry's cached rows) run on a thread of
their own, so a health check answers even while every control thread is held.

Pings of many sandboxes at once (``GET /v1/tree?busy=true``) run on a third pool, ``PROBE_WORKERS``
threads, each ping bounded by its own short timeout and the whole by a deadline: a frozen agent
costs one probe thread for a second, never a control thread, and shows as not answering.

A kill (``ending``) ends the sandbox's lane: waiting calls are answered 410 at once and the running
one 410 when its agent connection breaks, so nothing queued behind a loop waits forever.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter as Tally
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..errors import Busy, Conflict, Gone, TooManyRequests

PROBE_WORKERS = 32  # threads for pings of many sandboxes at once (the tree's busy column)


@dataclass
class Lane:
    """One sandbox's user-code calls: the one running and those waiting their turn."""

    running: str | None = None           # what runs ("an eval"), None when the lane is free
    since: float = 0.0
    waiting: deque = field(default_factory=deque)   # (future, what), first come first served
    ended: str | None = None             # why the sandbox is going away (a kill), if it is


class Admission:
    def __init__(self, *, max_long_calls: int = 128, max_long_calls_per_caller: int = 64,
                 control_workers: int = 64, sandbox_queue_size: int = 8, sandbox_queue_timeout: float = 60.0,
                 registry: CollectorRegistry | None = None):
        self.max_long_calls = max_long_calls
        self.max_long_calls_per_caller = max_long_calls_per_caller
        self.sandbox_queue_size = sandbox_queue_size
        self.sandbox_queue_timeout = sandbox_queue_timeout
        self.control_pool = ThreadPoolExecutor(control_workers, thread_name_prefix="forkd-control")
        self.long_pool = ThreadPoolExecutor(max_long_calls, thread_name_prefix="forkd-long")
        self.probe_pool = ThreadPoolExecutor(PROBE_WORKERS, thread_name_prefix="forkd-probe")
        self.health_pool = ThreadPoolExecutor(1, thread_name_prefix="forkd-health")
        self.admitted = 0                 # long calls holding a slot (running or waiting in a lane)
        self.running = 0                  # long calls running now (on a thread, or on the loop)
        self.control_running = 0
        self.callers: Tally = Tally()     # caller -> long calls holding a slot
        self.lanes: dict[str, Lane] = {}
        r = registry if registry is not None else CollectorRegistry()
        Gauge("forkd_long_calls_running", "Long calls (exec, eval, branch...) running now (on a thread, or an "
              "eval or exec on the event loop)",
              registry=r).set_function(lambda: self.running)
        Gauge("forkd_long_calls_waiting", "Long calls waiting for their sandbox's lane",
              registry=r).set_function(lambda: sum(len(lane.waiting) for lane in self.lanes.values()))
        Gauge("forkd_control_calls_running", "Control calls (list, kill, ping...) on a thread now",
              registry=r).set_function(lambda: self.control_running)
        Gauge("forkd_long_calls_cap", "Long calls the server admits at once (ForkdApp.max_long_calls)",
              registry=r).set(max_long_calls)
        Gauge("forkd_long_calls_per_caller_cap", "Long calls one caller may hold (ForkdApp.max_long_calls_per_caller)",
              registry=r).set(max_long_calls_per_caller)
        Gauge("forkd_sandbox_queue_size", "Calls that may wait for one sandbox's lane (ForkdApp.sandbox_queue_size)",
              registry=r).set(sandbox_queue_size)
        Gauge("forkd_control_workers", "Threads for control calls (ForkdApp.control_workers)",
              registry=r).set(control_workers)
        self.refused = Counter("forkd_calls_refused", "Long calls refused, by reason", ["reason"], registry=r)
        for reason in ("server_cap", "caller_cap", "sandbox_busy", "queue_timeout"):
            self.refused.labels(reason=reason)
        self.ended_by_kill = Counter("forkd_calls_ended_by_kill", "Calls answered 410 because their sandbox was "
                                     "killed while they ran or waited", registry=r)

    def close(self) -> None:
        for sandbox, lane in list(self.lanes.items()):
            self._end_waiters(lane, "the server is shutting down", sandbox)
        for pool in (self.control_pool, self.long_pool, self.probe_pool, self.health_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    # --- control ---------------------------------------------------------------------------------

    async def control(self, fn: Callable):
        self.control_running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.control_pool, fn)
        finally:
            self.control_running -= 1

    async def health(self, fn: Callable):
        """Run ``fn`` (a health check's cheap reads) on the health thread, never behind control calls."""
        return await asyncio.get_running_loop().run_in_executor(self.health_pool, fn)

    async def probe(self, fns: list[Callable], deadline: float) -> list:
        """Run ``fns`` (each bounded by its own timeout) on the probe pool, at most ``PROBE_WORKERS``
        at once server-wide, all within ``deadline`` seconds. Returns, per fn, its result or its
        exception; ``None`` for one not started by the deadline (it is not started at all)."""
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self.probe_pool, fn) for fn in fns]
        if not futures:
            return []
        done, pending = await asyncio.wait(futures, timeout=deadline)
        for future in pending:
            future.cancel()  # not started yet: never will be; a running one ends by its own timeout
        return [(f.exception() or f.result()) if f in done else None for f in futures]

    # --- long calls ------------------------------------------------------------------------------

    async def long(self, fn: Callable, *, caller: str, what: str, sandbox: str | None = None,
                   lane: bool = False, on_loop: Callable[[], Awaitable] | None = None):
        """Run ``fn`` as a long call of ``caller``; with ``lane``, in ``sandbox``'s lane. Once admitted,
        ``on_loop`` (if given) may make the call on the event loop instead: its result, or None
        where it would wait, and ``fn`` runs on a thread after all (loop_calls.py)."""
        self._take_slot(caller)
        try:
            if lane:
                await self._enter_lane(sandbox, what)
            try:
                return await self._run(fn, sandbox, what, lane, on_loop)
            finally:
                if lane:
                    self._leave_lane(sandbox)
        finally:
            self.admitted -= 1
            self.callers[caller] -= 1
            if self.callers[caller] <= 0:
                del self.callers[caller]

    async def _run(self, fn: Callable, sandbox: str | None, what: str, lane: bool, on_loop=None):
        self.running += 1
        try:
            result = None if on_loop is None else await on_loop()
            if result is None:
                result = await asyncio.get_running_loop().run_in_executor(self.long_pool, fn)
        except Exception as exc:
            if self._killed(sandbox):
                raise self._gone(sandbox, what) from exc
            raise
        finally:
            self.running -= 1
        if lane and self._killed(sandbox):  # an answer the kill made (an exec whose process it ended)
            raise self._gone(sandbox, what)
        return result

    def _killed(self, sandbox: str | None) -> bool:
        lane = self.lanes.get(sandbox) if sandbox is not None else None
        return lane is not None and lane.ended is not None

    def _gone(self, sandbox: str, what: str) -> Gone:
        self.ended_by_kill.inc()
        return Gone(f"sandbox {sandbox} was killed during this call ({what}); {self.lanes[sandbox].ended}")

    def _take_slot(self, caller: str) -> None:
        if self.admitted >= self.max_long_calls:
            self.refused.labels(reason="server_cap").inc()
            raise Busy(f"{self.admitted} long calls (exec, eval, run, files, branch, spawn...) are in progress, "
                       f"the most this server admits", hint="retry when one ends (or raise ForkdApp.max_long_calls)",
                       details={"in_progress": self.admitted, "setting": "ForkdApp.max_long_calls"})
        if self.callers[caller] >= self.max_long_calls_per_caller:
            self.refused.labels(reason="caller_cap").inc()
            raise TooManyRequests(f"you have {self.callers[caller]} long calls in progress, the most one caller may "
                                  f"hold", hint="wait for one to end (or raise ForkdApp.max_long_calls_per_caller)",
                                  details={"in_progress": self.callers[caller],
                                           "setting": "ForkdApp.max_long_calls_per_caller",
                                           "caller": "your token, and within it your X-Forkd-Client header if "
                                                     "you send one (each SDK client object sends its own)"})
        self.admitted += 1
        self.callers[caller] += 1

    async def _enter_lane(self, sandbox: str, what: str) -> None:
        lane = self.lanes.setdefault(sandbox, Lane())
        if lane.running is None and not lane.waiting:
            lane.running, lane.since = what, time.monotonic()
            return
        if lane.ended:
            raise Gone(f"sandbox {sandbox} is being killed; {lane.ended}")
        if len(lane.waiting) >= self.sandbox_queue_size:
            self.refused.labels(reason="sandbox_busy").inc()
            raise self._busy(sandbox, lane, f"{len(lane.waiting)} more calls already wait for it")
        turn = asyncio.get_running_loop().create_future()
        entry = (turn, what)
        lane.waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.sandbox_queue_timeout)
        except asyncio.TimeoutError:
            if turn.done() and not turn.exception():  # our turn came as the wait ran out: take it
                return
            lane.waiting.remove(entry)
            self._drop_if_idle(sandbox)
            self.refused.labels(reason="queue_timeout").inc()
            raise self._busy(sandbox, lane, f"this call waited {self.sandbox_queue_timeout:g} s for its turn") from None
        except asyncio.CancelledError:  # the client went away
            if turn.done() and not turn.cancelled() and not turn.exception():
                self._leave_lane(sandbox)  # the turn was handed to us: pass it on
            elif entry in lane.waiting:
                lane.waiting.remove(entry)
                self._drop_if_idle(sandbox)
            raise
        # the lane was handed over with lane.running already set for us (see _leave_lane)

    def _leave_lane(self, sandbox: str) -> None:
        lane = self.lanes.get(sandbox)
        if lane is None:
            return
        lane.running = None
        while lane.waiting:
            turn, what = lane.waiting.popleft()
            if not turn.done():
                lane.running, lane.since = what, time.monotonic()
                turn.set_result(None)
                return
        self._drop_if_idle(sandbox)

    def _drop_if_idle(self, sandbox: str) -> None:
        lane = self.lanes.get(sandbox)
        if lane is not None and lane.running is None and not lane.waiting:
            del self.lanes[sandbox]

    def _busy(self, sandbox: str, lane: Lane, why: str) -> Conflict:
        running = f"{lane.running} (for {time.monotonic() - lane.since:.1f} s)" if lane.running else "a call"
        return Conflict(f"sandbox {sandbox} is busy: it runs {running} and {why}",
                        hint="wait for it, interrupt it or kill it",
                        details={"interrupt": f"POST /v1/sandboxes/{sandbox}/interrupt",
                                 "kill": f"DELETE /v1/sandboxes/{sandbox} (forkd kill {sandbox}, %forkd kill {sandbox})"})

    # --- kills -----------------------------------------------------------------------------------

    def ending(self, sandbox: str, why: str) -> Callable[[bool], None]:
        """A kill of ``sandbox`` begins: waiting calls end now (410); the running one ends 410 when
        it fails. Returns ``done(killed)``, to call when the kill is over."""
        lane = self.lanes.get(sandbox)
        if lane is None:
            return lambda killed: None
        lane.ended = why
        self._end_waiters(lane, why, sandbox)

        def done(killed: bool) -> None:
            current = self.lanes.get(sandbox)
            if current is lane and not killed:
                lane.ended = None  # the kill failed: the sandbox lives on
        return done

    def _end_waiters(self, lane: Lane, why: str, sandbox: str) -> None:
        while lane.waiting:
            turn, _what = lane.waiting.popleft()
            if not turn.done():
                self.ended_by_kill.inc()
                turn.set_exception(Gone(f"sandbox {sandbox} was killed while this call waited for its turn; {why}"))
        self._drop_if_idle(sandbox)
