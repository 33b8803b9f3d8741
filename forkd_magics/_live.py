"""``%%forkd run``'s engine room: one cell in many sandboxes at once, each column filled in as its
sandbox prints, and Interrupt (or the kernel's stop button) stopping every one of them."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from IPython.display import clear_output, display

from forkd_server.client import ControllerError, Execution, Sandbox, ServerUnreachable

from ._render import RunResults, failed_execution

REFRESH = 0.25  # seconds between redraws of the live columns
SHOW_AFTER = 1.0  # a run that ends sooner shows only its result: no flicker, and a saved notebook
                  # (or nbval, which ignores display updates) sees the same output every time


def show_after() -> float:
    """Seconds before the live columns appear. Where outputs are compared with a saved copy by a
    tool that ignores display updates (nbval), $FORKD_RUN_SHOW_AFTER=inf keeps them from depending on
    how long the run took."""
    return float(os.environ.get("FORKD_RUN_SHOW_AFTER") or SHOW_AFTER)


def _apply(execution: Execution, event: dict) -> None:
    kind = event.get("type")
    if kind == "stream":
        if event.get("name") == "stdout":
            execution.stdout += event.get("text", "")
        else:
            execution.stderr += event.get("text", "")
    elif kind in ("display_data", "execute_result"):
        execution.results.append({"type": kind, "data": event.get("data", {})})
    elif kind == "error":
        execution.error = {k: event.get(k) for k in ("ename", "evalue", "traceback")}


def run_live(controller, targets: list[str], code: str, timeout: float | None = None,
             preludes: list[str] | None = None, explain=str) -> RunResults:
    """Run ``code`` in every target at once; ``preludes[i]`` runs first in the i-th (``--each``).
    ``explain(exc)`` words a failed request for the sandbox's column."""
    preludes = preludes or [""] * len(targets)
    prelude_of = dict(zip(targets, preludes))
    results = RunResults((sb, Execution()) for sb in targets)
    results.running = set(targets)
    changed = threading.Event()
    stopping = threading.Event()  # the user interrupted (not a --timeout)
    lock = threading.Lock()

    def one(sb: str) -> None:
        def on_event(event: dict) -> None:
            with lock:
                _apply(results[sb], event)
            changed.set()

        try:
            sandbox = Sandbox({"id": sb, "snapshot_tag": ""}, controller)
            if prelude_of[sb]:  # its own values first, in a cell of their own (the cell may start with %%)
                given = sandbox.run_code(prelude_of[sb], timeout)
                if given.error:
                    raise RuntimeError(f"--each values could not be set: {given.error.get('evalue')}")
            done = sandbox.run_code(code, timeout, on_event=on_event)
            if timeout and (done.error or {}).get("ename") == "KeyboardInterrupt" and not stopping.is_set():
                done.error = dict(done.error, evalue=f"stopped after --timeout {timeout:g} s")
        except (ControllerError, ServerUnreachable, ConnectionError, TimeoutError, OSError, RuntimeError) as exc:
            done = failed_execution(explain(exc))
        with lock:
            results[sb] = done
            results.running.discard(sb)
        changed.set()

    handle = None
    started, live_after = time.monotonic(), show_after()
    pool = ThreadPoolExecutor(max_workers=min(len(targets), 32), thread_name_prefix="forkd-run")
    futures = [pool.submit(one, sb) for sb in targets]
    try:
        interrupted_at = None
        while True:
            try:
                pending = wait(futures, timeout=REFRESH).not_done
                if not pending:
                    break
                if handle is None and time.monotonic() - started >= live_after:
                    with lock:
                        handle = display(results, display_id=True)
                elif handle is not None and changed.is_set():
                    changed.clear()
                    with lock:
                        handle.update(results)
                if interrupted_at is not None and time.monotonic() - interrupted_at > 10:
                    break  # they were asked to stop; what still runs is reported as running
            except KeyboardInterrupt:
                interrupted_at = time.monotonic()
                stopping.set()
                for sb in list(results.running):  # every sandbox's cell stops, not only the local wait
                    try:
                        controller.interrupt(sb)
                    except (ControllerError, ServerUnreachable):
                        pass
    finally:
        pool.shutdown(wait=False)
    with lock:
        results.running = set(results.running)
        results.interrupted = stopping.is_set()
    if handle is not None:
        # The live columns give way to the cell's result (the same columns, final): cleared when
        # the result arrives, so nothing flickers and a saved notebook keeps one copy.
        clear_output(wait=True)
    return results
