"""A failed tool call as the agent reads it: what failed and what to do, never our traceback.

Every tool runs through ``explained``: the SDK's errors (``ControllerError`` carries the server's two
lines, ``ServerUnreachable`` says where nothing answers) become a ``ToolError`` whose text is those
two lines, the second in this server's words (its tools) when the server's ``details`` give an
``mcp`` fix (the SDK puts the tool's name before them); anything else is a failure of this server,
logged here with its traceback and said to the agent in one line that names the exception's type only.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re

from mcp.server.mcpserver.exceptions import ToolError

from ..client import ControllerError, ServerUnreachable
from ._threads import off_loop

log = logging.getLogger("forkd.mcp")


class Refused(ToolError):
    """A request this server refuses before asking forkd (a notebook it does not know, bad input)."""

    def __init__(self, what: str, hint: str):
        super().__init__(f"{what}\n{hint}")


def describe(exc: BaseException) -> str:
    """The two lines an agent reads for ``exc``."""
    if isinstance(exc, ControllerError):
        mcp = exc.details.get("mcp")  # the server's fix in this server's own words (its tools), when it gave one
        if isinstance(mcp, str) and mcp:
            return f"{exc.what}\n{mcp}"
        taken = re.fullmatch(r"snapshot (\S+) already exists; DELETE first", exc.what)  # forkd's words, on its wire
        if taken:
            return (f"snapshot {taken[1]} already exists\n"
                    f"choose another tag, or delete that one first with delete_snapshot")
        return exc.message if exc.hint else f"{exc.what}\n{_hint_for_status(exc.status)}"
    if isinstance(exc, ServerUnreachable):
        return str(exc)
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, TimeoutError)):
        return str(exc)
    return (f"forkd's MCP server failed: {type(exc).__name__} (its log has the details)\n"
            f"try again; if it fails again, report it with the server's log")


def _hint_for_status(status: int) -> str:
    return {400: "fix the arguments as the message says",
            401: "set FORKD_TOKEN (or the MCP client's token) to the server's token",
            403: "use a token allowed to do this",
            404: "list_sandboxes / list_snapshots show what exists",
            409: "the message says what conflicts; retry once it is resolved",
            410: "the sandbox ended during the call: list_sandboxes shows what runs",
            429: "this caller has too many calls running: wait for some to finish",
            503: "the server is at its limit: retry shortly",
            507: "the server's data dir is full: delete snapshots it no longer needs"}.get(
        status, "retry; if it fails again, check the forkd server's log")


def explained(action: str):
    """Decorate a tool (sync or async): its failures become ``ToolError("<what>\\n<hint>")``; ``action``
    names it in the log. A sync tool becomes a coroutine run on the server's kept threads (``_threads``)."""

    def wrap(fn):
        def fail(exc: Exception):
            if isinstance(exc, ToolError):
                return exc
            if not isinstance(exc, (ControllerError, ServerUnreachable, IsADirectoryError, NotADirectoryError,
                                    TimeoutError)):
                log.exception("forkd mcp: %s failed", action)
            return ToolError(describe(exc))  # the SDK says "Error executing tool <name>: " before it

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args, **kwargs):
                try:
                    return await fn(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - every failure is said, none is a traceback
                    raise fail(exc) from None
            return run_async

        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - as above
                raise fail(exc) from None
        return off_loop(run)

    return wrap
