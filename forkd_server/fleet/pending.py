"""The record of a fork across hosts in flight: what a router killed mid-fork leaves for the next
one to settle (settling.py).

``fork_across`` (forks.py) records its intent in router.db before it makes anything: a pin of kind
``pending_fork`` under the tree's id, with the fork's snapshot tag, its home host and the router
process that runs it. The row goes when the tree is recorded, or once a failed fork has cleaned up.
A router killed in between (a ``kill -9``, a crash, the machine) leaves the row, and what the fork
made so far: its branch and some of its children, each labelled ``fork_tree_id=<tree>``.

A row names the router process that wrote it (machine, pid, and the pid's start time, so a later
process given the same pid is not taken for it): settling.py settles only rows whose process is
gone, or that their router gave up (``abandon``: a host went away mid-fork).
"""

from __future__ import annotations

import os
import socket

from .router import Router

PENDING = "pending_fork"


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is no such process: with
    the pid it names one process, not a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22; the name (field 2) may hold spaces
    except (OSError, IndexError, ValueError):
        return None


def owner() -> dict:
    """This router process, as a pending row names it."""
    return {"machine": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}


def running(who: dict) -> bool:
    """Whether the router process that wrote a row may still run (another machine's: it may)."""
    if who.get("gave_up"):
        return False
    if who.get("machine") != socket.gethostname():
        return True
    started = _started(who.get("pid")) if isinstance(who.get("pid"), int) else None
    return started is not None and started == who.get("started")


def begin(router: Router, tree_id: str, home: str, source: str, tag: str, user_tag: bool) -> None:
    """Record a fork across hosts before any of it is made."""
    row = {"source": source, "home": home, "snapshot_tag": tag, "user_tag": user_tag, "router": owner()}
    router.state.pin(PENDING, [(tree_id, row)], home)


def end(router: Router, tree_id: str) -> None:
    """The fork is recorded as a tree, or nothing of it is left."""
    router.state.unpin(PENDING, tree_id)


def abandon(router: Router, tree_id: str) -> None:
    """The fork failed in a way that left what it made (a host went away mid-way): its row is
    settled as a dead router's is, at the next beat with every host up."""
    row = router.state.record(PENDING, tree_id)
    if row is not None:
        router.state.pin(PENDING, [(tree_id, {**row, "router": {"gave_up": True}})], row["home"])


def rows(router: Router) -> dict[str, dict]:
    """tree id -> pending row, of every fork whose router process is gone or gave it up."""
    return {tree_id: row for tree_id, row in router.state.records(PENDING).items()
            if isinstance(row, dict) and not running(row.get("router") or {})}
