"""Where a blocking tool runs: threads the MCP server keeps between calls.

The mcp SDK runs a sync tool on an anyio worker thread, which lives as long as anyio's root task.
Inside jupyter-server and ``forkd serve`` (tornado's loop, no anyio root) that task is the request's
own, so every tool call started a thread and stopped it afterwards (a seventh of the server's
samples in a profile of ``eval_code`` calls). These threads outlive the calls, whatever carries
them; at most ``WORKERS`` tools block at once (the SDK's own limit is 40 too)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

WORKERS = 40
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="forkd-mcp-tool")
    return _pool


def off_loop(fn):
    """``fn`` (blocking) as a coroutine function that runs it on one of the kept threads, with the
    caller's context variables (as ``asyncio.to_thread`` does)."""

    @functools.wraps(fn)
    async def run(*args, **kwargs):
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(_threads(), call)

    return run
