"""Blocking SDK work on a thread while its steps reach the client as MCP progress notifications.

The SDK is synchronous; a tool that runs for a while (a cell, a spawn of many children) runs it
on a worker thread and hands it ``say``: a thread-safe callable taking one line per step, which
the tool's task turns into ``notifications/progress`` as they come.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, TypeVar

from mcp.server.mcpserver import Context

T = TypeVar("T")
EVENTS_GRACE = 2.0  # seconds a call's last events may trail its reply


async def run_reporting(ctx: Context | None, work: Callable[[Callable[[str], None]], T], *,
                        total: float | None = None, done: int = 0) -> T:
    """Run ``work(say)`` on a thread; each ``say(line)`` is one progress notification, counted on
    from ``done`` (the steps a caller reported before: progress only ever grows)."""
    loop = asyncio.get_running_loop()
    steps: asyncio.Queue = asyncio.Queue()
    finished = object()

    def say(line: str) -> None:
        try:
            loop.call_soon_threadsafe(steps.put_nowait, line)
        except RuntimeError:  # the loop is gone: nobody to tell
            pass

    result: dict = {}

    def run() -> None:
        try:
            result["value"] = work(say)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result["error"] = exc
        finally:
            try:
                loop.call_soon_threadsafe(steps.put_nowait, finished)
            except RuntimeError:
                pass

    threading.Thread(target=run, name="forkd-mcp-work", daemon=True).start()
    count = done
    while True:
        line = await steps.get()
        if line is finished:
            break
        count += 1
        if ctx is not None and (not total or count <= total):  # past the total it could only repeat it
            await ctx.report_progress(count, total, message=line)
    if "error" in result:
        raise result["error"]
    return result["value"]


class Following:
    """The server's events (``/v1/events``) read on a thread while a blocking call runs, subscribed
    before the call so none is missed: ``step(event)`` gives the line to say for an event, or None.

    ``settle(done)`` waits (at most ``EVENTS_GRACE``) until ``done()`` holds, for the events a reply
    can overtake; ``step`` and ``done`` run under one lock, so they may share plain state."""

    def __init__(self, ctl, say: Callable[[str], None], step: Callable[[dict], str | None]):
        self._ctl, self._say, self._step = ctl, say, step
        self._changed = threading.Condition()

    def __enter__(self) -> "Following":
        self._stream = self._ctl.events()
        self._reader = threading.Thread(target=self._follow, name="forkd-mcp-events", daemon=True)
        self._reader.start()
        return self

    def _follow(self) -> None:
        try:
            for event in self._stream:
                with self._changed:
                    line = self._step(event)
                    self._changed.notify_all()
                if line:
                    self._say(line)
        except Exception:  # noqa: BLE001 - the stream closed under us: progress is over
            pass

    def settle(self, done: Callable[[], bool]) -> None:
        with self._changed:
            self._changed.wait_for(done, timeout=EVENTS_GRACE)

    def __exit__(self, *exc) -> None:
        self._stream.close()
        self._reader.join(5)
