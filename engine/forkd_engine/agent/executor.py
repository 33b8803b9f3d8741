"""The sandbox's main thread: user code and forks run here, one job at a time.

User code must run on the main thread: only there does SIGINT become ``KeyboardInterrupt``, so an
interrupt stops a ``time.sleep(60)`` in the user's cell. Forks run here too when the sandbox is
idle: a fork keeps only the thread that called it, and this is the thread whose state (the shell,
the namespace, the signal handlers) a child must continue with. Requests arrive on other threads
(the agent's connections) and wait for their job.

A job queued behind a busy main thread waits at most until its own deadline; the queue is bounded,
so a caller behind a cell that never ends gets ``Busy`` instead of waiting forever.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Any, Callable

from . import generators


def without_interrupt_frame(tb):
    """``tb`` without the frame of the SIGINT handler that raised an interrupt's KeyboardInterrupt
    (always the innermost one): the user sees their code stop at their own line, as under ipykernel,
    whose handler is CPython's own and leaves no frame. Cut in place, so the exception's
    ``__traceback__`` is the same shorter chain."""
    last, before = tb, None
    while last is not None and last.tb_next is not None:
        last, before = last.tb_next, last
    if last is None or last.tb_frame.f_code is not Executor._on_sigint.__code__:
        return tb
    if before is None:
        return None
    before.tb_next = None
    return tb


INSIST_EVERY = 0.2  # s between SIGINTs while an interrupt has not reached the cell
INSIST_FOR = 10.0   # s after which the cell is left to its own devices (it ignores SIGINT)


class Busy(Exception):
    """The main thread is running something else and the job could not start in time."""


class Job:
    def __init__(self, fn: Callable[[], Any], what: str, user_code: bool,
                 then: Callable[[Any], None] | None = None):
        self.fn, self.what, self.user_code = fn, what, user_code
        self.then = then  # given fn's result once the main thread is idle again (a session's reply)
        self.done = threading.Event()
        self.started_at: float | None = None
        self.cancelled = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._state = threading.Lock()  # guards started_at vs cancelled

    def wait(self, timeout: float | None = None) -> Any:
        if not self.done.wait(timeout):
            raise TimeoutError(f"{self.what} did not finish within {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.result


class Executor:
    def __init__(self, max_queued: int = 8):
        self.max_queued = max_queued
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.current: Job | None = None
        self.main_ident: int | None = None
        self._interrupting = False
        self.after_user_code: Callable[[], None] | None = None  # told when user code ran (memory upkeep)
        self.started = 0  # jobs started so far: "nothing ran since" is this number unchanged

    # --- other threads ---------------------------------------------------------------------------

    def submit(self, fn: Callable[[], Any], what: str, *, user_code: bool = True,
               then: Callable[[Any], None] | None = None) -> Job:
        if self.jobs.qsize() >= self.max_queued:
            raise Busy(self._busy_message(f"{self.max_queued} more requests are already waiting"))
        job = Job(fn, what, user_code, then)
        self.jobs.put(job)
        return job

    def call(self, fn: Callable[[], Any], what: str, *, user_code: bool = True,
             start_within: float | None = None) -> Any:
        """Run ``fn`` on the main thread and return its result. If it has not started within
        ``start_within`` seconds (the main thread is busy), it is dropped and ``Busy`` raised."""
        job = self.submit(fn, what, user_code=user_code)
        if start_within is not None and not job.done.wait(start_within):
            with job._state:
                if job.started_at is None:
                    job.cancelled = True
                    raise Busy(self._busy_message(f"{what} could not start within {start_within:g} s"))
        return job.wait()

    def busy(self) -> tuple[str, float] | None:
        """(what the main thread runs, since when) or None when idle."""
        job = self.current
        return (job.what, job.started_at or time.time()) if job is not None else None

    def _busy_message(self, why: str) -> str:
        running = self.busy()
        if running is None:
            return f"the sandbox is busy: {why}"
        return (f"the sandbox is busy running {running[0]} (for {time.time() - running[1]:.1f} s): {why}; "
                f"interrupt it or wait")

    def interrupt(self) -> bool:
        """Raise KeyboardInterrupt in the user code the main thread runs; False when there is none."""
        job = self.current
        if job is None or not job.user_code or self.main_ident is None:
            return False
        self._interrupting = True
        signal.pthread_kill(self.main_ident, signal.SIGINT)
        try:
            threading.Thread(target=self._insist, args=(job,), name="forkd-interrupt", daemon=True).start()
        except RuntimeError:  # at the sandbox's pids limit: the one signal sent must do
            pass
        return True

    def _insist(self, job: Job) -> None:
        """Send SIGINT again while ``job`` runs and no KeyboardInterrupt was raised for it yet: a
        signal can reach the main thread where its handler cannot act (in C code that retries on
        EINTR, or masked a moment), and the user's interrupt must not be lost to that. One
        interrupt still raises one KeyboardInterrupt: the handler clears ``_interrupting``."""
        deadline = time.monotonic() + INSIST_FOR
        while not job.done.wait(INSIST_EVERY) and time.monotonic() < deadline:
            if self.current is not job or not self._interrupting:
                return
            signal.pthread_kill(self.main_ident, signal.SIGINT)

    # --- the main thread -------------------------------------------------------------------------

    def _on_sigint(self, _signum, _frame) -> None:
        job = self.current
        if self._interrupting and job is not None and job.user_code:
            self._interrupting = False
            raise KeyboardInterrupt
        # Between jobs, or in the agent's own work (a fork): ignored.

    def run_forever(self) -> None:
        """Serve jobs on this thread (it must be the main thread) until a None job arrives."""
        self.main_ident = threading.get_ident()
        signal.signal(signal.SIGINT, self._on_sigint)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.run(job)

    def run(self, job: Job) -> None:
        with job._state:
            if job.cancelled:
                return
            job.started_at = time.time()
        self.started += 1
        self._interrupting = False
        self.current = job
        try:
            job.result = job.fn()
        except BaseException as exc:  # noqa: BLE001 - a late KeyboardInterrupt included: it is the job's
            job.error = exc
        finally:
            self.current = None
            self._interrupting = False
            job.done.set()
        # Answered only now: whoever gets the answer finds the sandbox idle, never busy with it.
        if job.then is not None and job.error is None:
            try:
                job.then(job.result)
            except Exception:  # noqa: BLE001 - a reply that cannot be sent (the client left)
                pass
        if job.user_code:
            generators.notice()  # before anything can fork what the code made (see generators.py)
            if self.after_user_code is not None:
                self.after_user_code()

    def after_fork(self) -> None:
        """In a fork made from the main thread: nothing queued here belongs to the child."""
        self.jobs = queue.Queue()
        self.current = None
        self.main_ident = threading.get_ident()
        self._interrupting = False
