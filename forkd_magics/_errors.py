"""Server errors in plain language: one line of what failed, one of what to do, the rest collapsed.

The server says each error that way (``ControllerError.what``, ``.hint``, ``.details``); a notebook
user reads it after ``forkd SUB:``. A few are worded again here: a token refused (how to give one
here), a sandbox that did not answer (no internal socket path), a failure of forkd or its machine
(said to be theirs). The details (figures, a traceback, the same fix in REST/SDK/CLI words) are shown
under the error, collapsed (``show_details``): the two lines stay readable, nothing is lost.
"""

from __future__ import annotations

import html
import json
import re
import socket
from dataclasses import dataclass, field

from forkd_server.client import ControllerError, ServerUnreachable

_AGENT_AT = re.compile(r"\bagent at /\S+?\.sock\b")
_SOCKET = re.compile(r"\s*(?:at )?/\S+?\.sock\b")
_NO_ANSWER = re.compile(r"did not answer within ([0-9.]+) ?s")


def _internal_paths_out(text: str) -> str:
    """The server's socket paths mean nothing to the user: "agent at /…/x.sock" is the sandbox's agent."""
    return _SOCKET.sub("", _AGENT_AT.sub("the sandbox's agent", text))


@dataclass
class Explained:
    """A failure as the notebook says it: ``what`` happened, ``hint`` what to do, ``details`` the rest."""

    what: str
    hint: str = ""
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.what}\n{self.hint}" if self.hint else self.what


def explained(exc: BaseException, server: str) -> Explained:
    """A failed request in the notebook's words: the server's, reworded where they mislead."""
    if isinstance(exc, ControllerError):
        what, hint = _internal_paths_out(exc.what), _internal_paths_out(exc.hint)
        details = {**exc.details, "http": f"{exc.status} from {exc.url}"}
        if hint and details.get("magic"):  # the fix in the notebook's own words
            hint += f": {details['magic']}"
        if exc.status == 401:
            return Explained(f"the server at {server} refused the token ({what})",
                             f"set FORKD_TOKEN, or %forkd connect {server} (it asks for the token)", details)
        if _NO_ANSWER.search(what):
            return Explained(what, "the sandbox may be busy with an earlier cell or stuck: give it more time "
                                   "(--timeout), interrupt it, or kill it", details)
        taken = re.fullmatch(r"snapshot (\S+) already exists; DELETE first", what)  # forkd's words, kept on its wire
        if taken:
            return Explained(f"snapshot {taken[1]} already exists",
                             f"choose another tag, or delete that snapshot first: %forkd delete {taken[1]}", details)
        missing = re.fullmatch(r"(sandbox|snapshot) \S+ not found( on any host of the fleet)?", what)
        if exc.status == 404 and missing and not hint:
            kinds = {"sandbox": "sandboxes", "snapshot": "snapshots"}[missing[1]]
            return Explained(what, f"check the name: %forkd ls lists this notebook's {kinds} "
                                   f"(--everyone: the server's)", details)
        if exc.status >= 500 and not hint:
            return Explained(f"{what} (the forkd server failed, not your code)",
                             "run this again, and if it fails again, restart the server (its log says more)", details)
        return Explained(what, hint, details)
    if isinstance(exc, ServerUnreachable):  # a ServerTimeout too
        return Explained(exc.what, exc.hint, exc.details)
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return Explained(f"the server at {server} did not answer in time ({exc or 'timed out'})",
                         "it may be busy: run this again, or check the server")
    what, _, rest = _internal_paths_out(str(exc)).partition("\n")
    return Explained(what, rest.strip())


def explain(exc: BaseException, server: str) -> str:
    """``explained`` as text: its two lines."""
    return str(explained(exc, server))


def _lines(details: dict) -> list[str]:
    out = []
    for key, value in details.items():
        text = value if isinstance(value, str) else json.dumps(value)
        first, *more = text.splitlines() or [""]
        out.append(f"{key}: {first}")
        out.extend(f"    {line}" for line in more)
    return out


def details_bundle(details: dict) -> dict:
    """The display data of an error's details: an HTML ``<details>``, closed (the notebook shows a
    "details" line that opens on a click), and plain lines for a front end without HTML."""
    lines = _lines(details)
    body = html.escape("\n".join(lines))
    return {"text/plain": "details:\n" + "\n".join(f"  {line}" for line in lines),
            "text/html": ('<details class="forkd-error-details"><summary style="cursor:pointer;opacity:.7">'
                          'details</summary><pre style="margin:2px 0 0 1em;white-space:pre-wrap;'
                          f'word-break:normal;overflow-wrap:anywhere">{body}</pre></details>')}


def show_details(shell, details: dict) -> None:
    """Show ``details`` under the error of the cell that runs now, once it has been shown. A magic
    run outside a cell (from code) shows nothing: the next cell drops what was left."""
    if shell is None or not details:
        return
    events = shell.events

    def done() -> None:
        for name, callback in (("post_run_cell", show), ("pre_run_cell", drop)):
            if callback in events.callbacks[name]:
                events.unregister(name, callback)

    def show(result=None) -> None:
        done()
        shell.display_pub.publish(data=details_bundle(details), metadata={})

    def drop(info=None) -> None:
        done()

    events.register("post_run_cell", show)
    events.register("pre_run_cell", drop)
