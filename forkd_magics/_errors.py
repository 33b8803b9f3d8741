"""Server errors in plain language: what failed, in whose code, and what to do.

The server's ``{"error": ...}`` messages are written for the API; a notebook user reads them after
``forkd SUB:``. Three kinds are worded again here: an exception in the user's own setup code (shown
as its traceback summary, never as "HTTP 500"), a failure of forkd or its machine (said to be
theirs, with where to look), and a sandbox that did not answer (no internal socket path).
"""

from __future__ import annotations

import re
import socket

from forkd_server.client import ControllerError, ServerUnreachable

_AGENT_AT = re.compile(r"\bagent at /\S+?\.sock\b")
_SOCKET = re.compile(r"\s*(?:at )?/\S+?\.sock\b")
_CELL_LINE = re.compile(r'File "<cell>", line (\d+)')
_NO_ANSWER = re.compile(r"did not answer within ([0-9.]+) ?s")


def _internal_paths_out(text: str) -> str:
    """The server's socket paths mean nothing to the user: "agent at /…/x.sock" is the sandbox's agent."""
    return _SOCKET.sub("", _AGENT_AT.sub("the sandbox's agent", text))


def user_code_failure(message: str) -> str | None:
    """The user's own setup raising or exiting non-zero, as the user would want to read it."""
    m = re.search(r"setup code failed: (.*)", message, re.S)
    if m:
        lines = [ln for ln in m.group(1).strip().splitlines() if ln.strip()]
        if lines and lines[0].startswith("Traceback"):
            lines = lines[1:]
        error = lines[-1] if lines else "an exception"
        # the setup is its own cell ("<cell>"): its line numbers count from the setup's first line
        frames = ["    " + _CELL_LINE.sub(r"setup line \1", ln.strip()) for ln in lines[:-1]]
        return "\n".join([f"your setup code raised {error}", *frames,
                          "nothing was created: fix the setup and run this again"])
    m = re.search(r"setup failed: (.*)", message, re.S)
    if m:
        return (f"your setup code raised {m.group(1).strip()}\n"
                f"nothing was created: fix the setup and run this again")
    m = re.search(r"setup command (.*?) (?:exited|failed: exit) (-?\d+): ?(.*)", message, re.S)
    if m:
        detail = m.group(3).strip()
        return (f"your setup command {m.group(1)} exited {m.group(2)}" + (f":\n    {detail}" if detail else "")
                + "\nnothing was created: fix the command and run this again")
    return None


def explain(exc: BaseException, server: str) -> str:
    """One message for a failed request: the server's words, reworded where they mislead."""
    if isinstance(exc, ControllerError):
        mine = user_code_failure(exc.message)
        if mine:
            return mine
        message = _internal_paths_out(exc.message)
        if exc.status == 401:
            return (f"the server at {server} refused the token ({message}): set FORKD_TOKEN, or "
                    f"%forkd connect {server} (it asks for the token)")
        if exc.status == 404:
            return f"{message} on {server}"
        waited = _NO_ANSWER.search(message)
        if waited:
            return (f"{message}: the sandbox may be busy with an earlier cell or stuck; give it more time "
                    f"(--timeout), interrupt it, or kill it")
        if exc.status >= 500:
            return (f"{message}\nthe forkd server failed (HTTP {exc.status}), not your code: its log says more; "
                    f"run this again, and if it fails again, restart the server")
        return message  # a 4xx says what to do
    if isinstance(exc, ServerUnreachable):
        return str(exc)
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return (f"the server at {server} did not answer in time ({exc or 'timed out'}); it may be busy: "
                f"run this again, or check the server")
    return _internal_paths_out(str(exc))
