"""Why a sandbox ended, said where the user looks: its ``killed`` event, the 404 of its id, the 410
of a call it died during, and the forkd kernel's "HEAD is gone".

A sandbox killed by its limits used to just vanish. Its engine reads the kernel's counters from its
cgroup before its leaves go (``Engine.limits_hit``): an OOM kill at its memory limit, a huge page
refused past its cap (SIGBUS), a fork refused at its pids limit. The registry keeps the end of the
last ``ENDED_KEPT`` sandboxes (when, why), so a later ``GET`` of the id answers 404 saying so rather
than a bare "not found".

An end is ``{"reason", "limit_hit", "hint", "details"}``, said as an error is (errors.py):
``reason`` is what happened in one line ("it died of its memory limit (64 MiB)"), ``hint`` what to
do in one more, ``details`` the rest: the kernel's counters, the value, and the fix in the words of
each front end (REST, SDK, CLI, magic).
"""

from __future__ import annotations

import json
import signal
import time

from forkd_engine import ExitStatus, LimitHit

from ..errors import NotFound
from .checks import host_memory_mib

KILLED = "it was killed (DELETE /v1/sandboxes/{id})"
UNEXPECTED = ("its process ended unexpectedly (no limit of its was reached: it exited, crashed or was killed "
              "outside forkd)")
LIMIT_NAMES = {"memory": "memory limit", "huge_pages": "huge-page cap", "pids": "pids limit"}


def _larger(mib: int) -> int | str | None:
    """A limit to suggest above ``mib``: twice it, or "host" (all of this host's memory) where that
    is less; None where ``mib`` is all of it already (a larger one would be refused)."""
    host = host_memory_mib()
    if mib >= host:
        return None
    more = max(mib * 2, 64)
    return more if more < host else "host"


# What a signal that ended a sandbox's Python usually means, for the ones user code meets.
_SIGNALS = {
    signal.SIGKILL: "was killed by SIGKILL from outside forkd (a kill -9, or the host's own OOM killer)",
    signal.SIGSEGV: "crashed with SIGSEGV (a segmentation fault, usually in a C extension)",
    signal.SIGABRT: "aborted (SIGABRT: os.abort(), or a failed assertion in a C extension)",
    signal.SIGBUS: "got SIGBUS (a memory access the system could not back: a huge page it could not supply, "
                   "or a mapped file cut short)",
    signal.SIGFPE: "crashed with SIGFPE (an arithmetic fault in a C extension)",
    signal.SIGILL: "crashed with SIGILL (an illegal instruction in a C extension)",
}


def how(status: ExitStatus | None) -> str | None:
    """How a process ended, said for a user: "its Python exited with status 3 (...)"; None if unknown."""
    if status is None:
        return None
    if status.note is not None:
        return status.note
    if status.signal is not None:
        said = _SIGNALS.get(status.signal)
        if said is None:
            try:
                name = signal.Signals(status.signal).name
            except ValueError:
                name = f"signal {status.signal}"
            said = f"was killed by {name} (signal {status.signal}) from outside forkd"
        return f"its Python {said}"
    return (f"its Python exited with status {status.code} (os._exit({status.code}), or a C extension that "
            f"called exit())")

def raise_hint(tag: str, mib: int) -> str:
    """What to do when a sandbox of ``tag`` needs more memory than ``mib``, in one line
    (``ways_to_raise``: the same in each front end's words)."""
    more = _larger(mib)
    if more is None:
        return (f"its limit was all of this host's memory ({mib} MiB): to go on, free memory on this host (end "
                f"sandboxes, delete snapshots) or run {tag} on a host with more")
    return f"to go on, start a sandbox of {tag} with a larger memory_limit_mib, e.g. {more}"


def ways_to_raise(tag: str, mib: int) -> dict:
    """``raise_hint`` as each front end says it: for an error's details (none where no larger limit
    exists here)."""
    more = _larger(mib)
    if more is None:
        return {}
    return {"rest": f'POST /v1/sandboxes {{"snapshot_tag": "{tag}", "memory_limit_mib": {json.dumps(more)}}}',
            "sdk": f"spawn_sandboxes({tag!r}, memory_limit_mib={more!r})",
            "cli": f"forkd spawn --tag {tag} --memory-limit-mib {more}",
            "magic": f"%forkd fork --tag {tag} --memory-limit-mib {more}",
            "workspace": "a workspace takes memory_limit_mib when it is created"}


TEMPLATE_ENDED = "snapshot is not bootable: its template process ended unexpectedly"


def template_ended(status: ExitStatus | None) -> str:
    """The warning of a snapshot whose template's process ended outside forkd's control."""
    said = how(status)
    return f"{TEMPLATE_ENDED}: {said}" if said else TEMPLATE_ENDED


def died(row: dict, hits: list[LimitHit], status: ExitStatus | None = None) -> dict:
    """The end of a sandbox whose process ended on its own, from the limits its cgroup says it hit
    and, where its engine knows it, how its process ended (``status``)."""
    said = how(status)
    if not hits:
        return {"reason": said or UNEXPECTED, "limit_hit": None, "hint": None,
                "details": {"limits": "none of its limits was reached"} if said else {}}
    # The OOM killer (or a refused huge page) ends a process; a refused fork only fails a call.
    first = next((h for h in hits if h.limit != "pids"), hits[0])
    details = {"limit": first.limit, "kernel": "; ".join(h.message for h in hits)}
    if first.limit == "pids":
        # What ended it, when known, was not the refused fork: that is said first.
        reason = said or f"it died of its pids limit ({first.value} processes and threads)"
        hint = "run fewer processes and threads at once: the pids limit is the same for every sandbox of this server"
        details["limit_processes"] = first.value
    else:
        limit = row.get("memory_limit_mib") or first.value
        reason = f"it died of its {LIMIT_NAMES[first.limit]} ({first.value} MiB)"
        if first.limit == "huge_pages":
            reason = f"it died of its huge-page cap ({first.value} MiB, as much as its memory limit)"
        hint = raise_hint(row["snapshot_tag"], limit)
        details.update(limit_mib=first.value, **ways_to_raise(row["snapshot_tag"], limit))
    return {"reason": reason, "limit_hit": first.limit, "hint": hint, "details": details}


def killed(sandbox_id: str, reason: str | None = None) -> dict:
    """The end of a sandbox killed by a call: ``reason``, when its caller said why (a fork tree's
    promote), else that it was killed."""
    return {"reason": reason or KILLED.format(id=sandbox_id), "limit_hit": None, "hint": None, "details": {}}


def not_found(sandbox_id, ended: dict | None) -> NotFound:
    """404 for a sandbox id: with what is known of its end, when it is remembered."""
    if ended is None:
        return NotFound(f"sandbox {sandbox_id} not found")
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ended["ended_at"]))
    return NotFound(f"sandbox {sandbox_id} not found: {ended['reason']}", hint=ended.get("hint"),
                    details={"ended_at": at, **(ended.get("details") or {})},
                    ended={"at": ended["ended_at"], "reason": ended["reason"], "limit": ended["limit_hit"]})
