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
