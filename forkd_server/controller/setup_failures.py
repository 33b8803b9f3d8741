"""A snapshot's setup that failed, said as what it is: the user's own code (or command) failing, or
its limits stopping it. One line of what happened, one of what to do; the traceback, the command's
output and the limits' figures go in the error's details.

The engines say it in one text (``InvalidSpec``): ``setup code failed: <traceback>``, ``setup
command [...] exited N: <stderr>``, ``setup failed: <error>``, with `` [stopped by its limits: ...]``
at the end when a limit stopped it. This reads that text; what it does not recognise stays as the
engine said it, its first line the what and the rest in details.
"""

from __future__ import annotations

import re

from ..errors import BadRequest

_LIMITS = re.compile(r"\s*\[stopped by its limits: (.*?)(?:\. (A setup runs within .*))?\]\s*$", re.S)
_CODE = re.compile(r"setup code failed: (.*)", re.S)
_COMMAND = re.compile(r"setup command (.*?) (?:exited|failed: exit) (-?\d+): ?(.*)", re.S)
_VM_CODE = re.compile(r"setup failed: (.*)", re.S)  # the VM engine's: the exception's type and message
_CELL_LINE = re.compile(r'File "<cell>", line (\d+)')
_LATE = re.compile(r"did not finish within \S+ s \(setup_timeout_secs")  # either engine's words


def setup_refusal(tag: str, text: str) -> BadRequest:
    """The 400 of a setup that failed: ``text`` is the engine's account of it."""
    details: dict = {}
    limits = _LIMITS.search(text)
    if limits:
        text = text[:limits.start()]
        details["limits"] = limits.group(1)
        if limits.group(2):
            details["setup_limits"] = limits.group(2)
    what, again = _said(tag, text, details)
    if limits:
        hit = limits.group(1)
        what = f"snapshot {tag}: its setup was stopped by its limits: {hit.split('; ')[0]}"
        room = ("start fewer processes and threads in it" if "pids limit" in hit and "memory" not in hit
                else "give it more memory with memory_limit_mib, or make it smaller")
        return BadRequest(what, hint=f"nothing was created: {room}, and create the snapshot again", details=details)
    return BadRequest(what, hint=again and f"nothing was created: {again}", details=details)


def _said(tag: str, text: str, details: dict) -> tuple[str, str | None]:
    """(what, what to fix) of the setup's own failure; its traceback or output into ``details``."""
    code = _CODE.search(text)
    if code:
        trace = _CELL_LINE.sub(r"setup line \1", code.group(1).strip())  # the setup counts from its first line
        lines = [ln for ln in trace.splitlines() if ln.strip()]
        error = lines[-1].strip() if lines else "an exception"
        where = re.findall(r"setup line (\d+)", trace)
        details["traceback"] = trace
        return (f"snapshot {tag}: your setup code raised {error}" + (f" (setup line {where[-1]})" if where else ""),
                "fix the setup and create the snapshot again")
    if _LATE.search(text):
        details.update(sdk="setup_timeout_secs=", cli="--setup-timeout-secs S")
        return text.strip(), "give it longer with setup_timeout_secs, and create the snapshot again"
    command = _COMMAND.search(text)
    if command:
        if command.group(3).strip():
            details["output"] = command.group(3).strip()
        return (f"snapshot {tag}: your setup command {command.group(1)} exited {command.group(2)}",
                "fix the command and create the snapshot again")
    raised = _VM_CODE.match(text)
    if raised:
        first, _, rest = raised.group(1).strip().partition("\n")
        if rest.strip():
            details["output"] = rest.strip()
        return f"snapshot {tag}: your setup code raised {first}", "fix the setup and create the snapshot again"
    first, _, rest = text.strip().partition("\n")
    if rest.strip():
        details["output"] = rest.strip()
    return first, None
