"""Settling forks across hosts that their router did not finish (pending.py keeps their rows).

A router killed mid-fork (a ``kill -9``, a crash, the machine) leaves the fork's row, and what the
fork made so far: its branch and some of its children, each labelled ``fork_tree_id=<tree>``. Every
router settles, at each heartbeat, the rows whose process is gone: once every host it knows is up (a
child may be on any of them), it kills the sandboxes labelled with the tree on each host, saying
why in each one's 404, and releases the branch from every host and the store unless the fork's
caller named it (its tag is theirs). A row whose tree was recorded only lost its delete: it goes.
A row of a process still running (this router's forks in flight, another router's on this machine)
is left to it; one written on another machine is left too, since whether its router runs cannot be
told from here.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

from ..controller.wire import FORK_TREE_LABEL
from . import pending
from .forks import TREE, release
from .hosts import HostError
from .router import Router

log = logging.getLogger("forkd.router")


async def settle(router: Router, tree_id: str, row: dict) -> bool:
    """Undo what the unfinished fork ``tree_id`` made; False when it must wait (a host is not up)."""
    if router.state.record(TREE, tree_id) is not None:
        pending.end(router, tree_id)  # it finished: only the row's delete was lost
        return True
    hosts = list(router.hosts.values())
    if not hosts or not all(h.up for h in hosts):
        return False  # a child of it may be on a host that is not up
    label = quote(f"{FORK_TREE_LABEL}={tree_id}", safe="")
    what = "a host went away mid-fork" if (row.get("router") or {}).get("gave_up") else "its router stopped"
    why = f"it was a child of fork tree {tree_id}, which was never finished ({what})"
    killed = 0
    for host in hosts:
        try:
            listed = await host.get_json(f"/v1/sandboxes?label={label}", router.settings.host_timeout)
        except HostError:
            return False
        ids = [s["id"] for s in listed if isinstance(s, dict) and isinstance(s.get("id"), str)]
        await router.kill(host, ids, reason=why)
        killed += len(ids)
    tag = row["snapshot_tag"]
    if row.get("user_tag"):
        kept = f"its snapshot {tag} stays (its tag was given by the fork's caller)"
    else:
        home = router.hosts.get(row.get("home")) or hosts[0]
        kept = await release(router, home, tag)
    pending.end(router, tree_id)
    log.warning("fork of %s into tree %s across hosts was never finished (%s): %d %s killed, %s",
                row.get("source"), tree_id, what, killed, "child" if killed == 1 else "children", kept)
    return True


async def settle_all(router: Router) -> None:
    """Settle every pending row whose router process is gone."""
    for tree_id, row in pending.rows(router).items():
        await settle(router, tree_id, row)


async def _forever(router: Router) -> None:
    while not router.stopping:
        try:
            await settle_all(router)
        except Exception:  # noqa: BLE001 - tried again at the next beat
            log.exception("settling unfinished forks failed")
        if not router.stopping:
            await asyncio.sleep(router.settings.heartbeat)


def watch(router: Router) -> asyncio.Task:
    """Settle unfinished forks now and at every heartbeat from now on (a host that is down delays
    them until it is up); the task ends with the router (``Router.stop`` cancels it)."""
    task = asyncio.ensure_future(_forever(router))
    router.chores.append(task)
    return task

