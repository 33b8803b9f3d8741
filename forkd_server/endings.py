"""Why a sandbox ended, said where the user looks: its ``killed`` event, the 404 of its id, the 410
of a call it died during, and the forkd kernel's "HEAD is gone".

A sandbox killed by its limits used to just vanish. Its engine reads the kernel's counters from its
cgroup before its leaves go (``Engine.limits_hit``): an OOM kill at its memory limit, a huge page
refused past its cap (SIGBUS), a fork refused at its pids limit. The reason names the limit, its
value and how to raise it. The registry keeps the end of the last ``ENDED_KEPT`` sandboxes (when,
why), so a later ``GET`` of the id answers 404 saying so rather than a bare "not found".
"""

from __future__ import annotations

import time

from forkd_engine import LimitHit

from .errors import NotFound

KILLED = "it was killed (DELETE /v1/sandboxes/{id})"
UNEXPECTED = ("its process ended unexpectedly (no limit of its was reached: it exited, crashed or was killed "
              "outside forkd)")


def raise_hint(tag: str, mib: int) -> str:
    """How to give a sandbox of ``tag`` more memory than ``mib``, in each front end's words."""
    more = max(mib * 2, 64)
    return (f"to give a sandbox more, spawn it with a larger memory_limit_mib (REST POST /v1/sandboxes "
            f"{{\"snapshot_tag\": \"{tag}\", \"memory_limit_mib\": {more}}}, SDK spawn_sandboxes({tag!r}, "
            f"memory_limit_mib={more}), %forkd fork --tag {tag} --memory-limit-mib {more}; a workspace takes it at create)")


def died(row: dict, hits: list[LimitHit], seen: str | None = None) -> dict:
    """The end of a sandbox whose process ended on its own: ``{"reason", "limit_hit"}``. ``seen``:
    what its engine saw end it (a VM's guest kernel panic), when no limit did."""
    if not hits:
        return {"reason": seen or UNEXPECTED, "limit_hit": None}
    # The OOM killer (or a refused huge page) ends a process; a refused fork only fails a call.
    first = next((h for h in hits if h.limit != "pids"), hits[0])
    said = "; ".join(h.message for h in hits)
    if first.limit == "pids":
        hint = ("the pids limit is the same for every sandbox of this server; run fewer processes and threads at "
                "once")
    else:
        limit = row.get("memory_limit_mib") or first.value
        hint = raise_hint(row["snapshot_tag"], limit)
        if first.limit == "huge_pages":
            hint = "its huge-page cap is its memory limit: " + hint
    name = {"memory": "memory limit", "huge_pages": "huge-page cap", "pids": "pids limit"}[first.limit]
    return {"reason": f"it died of its {name}: {said}. To go on: {hint}", "limit_hit": first.limit}


def killed(sandbox_id: str) -> dict:
    return {"reason": KILLED.format(id=sandbox_id), "limit_hit": None}


def not_found(sandbox_id, ended: dict | None) -> NotFound:
    """404 for a sandbox id: with what is known of its end, when it is remembered."""
    if ended is None:
        return NotFound(f"sandbox {sandbox_id} not found")
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ended["ended_at"]))
    return NotFound(f"sandbox {sandbox_id} not found: it ended at {at}: {ended['reason']}",
                    ended={"at": ended["ended_at"], "reason": ended["reason"], "limit": ended["limit_hit"]})
