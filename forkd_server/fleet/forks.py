"""A fork tree's children through the router, with ids unique across the fleet.

Hosts number sandboxes per host (``sb-<second>-<n>``), so a fork on one host can hand out an id a
sandbox on another host already has. A spawn's clash is spawned again by the router
(``Router.spawn_part``); a fork's children are made by the host itself, so a clashing child is made
again here, before the fork is answered: killed on its host, and a new child spawned there from the
fork's snapshot with the same labels (its ``fork_tree_id`` among them, so the tree counts it) and
memory limit. Nothing ran in it yet, so the new child is the same copy of the snapshot.
"""

from __future__ import annotations

import logging
from typing import Any

from .hosts import Host
from .placement import Part
from .router import Router

log = logging.getLogger("forkd.router")


async def settle_children(router: Router, host: Host, reply: dict, headers: dict) -> tuple[int, Any]:
    """Pin the fork's children to ``host``, each under an id no other host uses; (201, the reply
    with its children as made) or, if a child could not be made again, that spawn's error with the
    fork's other children killed (a fork is all or nothing, as a spawn is)."""
    kids = [k for k in reply.get("sandboxes") or [] if isinstance(k, dict) and isinstance(k.get("id"), str)]
    taken = set(router.state.claim("sandbox", [(k["id"], k) for k in kids], host.url))
    clash = [k for k in kids if k["id"] in taken]
    good = [k for k in kids if k not in clash]
    if clash:
        snapshot = reply.get("snapshot") or {}
        log.warning("host %s forked children whose ids another host uses (%s): made again under new ids",
                    host.url, ", ".join(k["id"] for k in clash))
        await router.kill(host, [k["id"] for k in clash], unpin=False)  # their room is the new ones'
        first = clash[0]
        body = {"snapshot_tag": snapshot.get("tag") or first.get("snapshot_tag"), "n": len(clash),
                "labels": first.get("labels") or {}}
        if first.get("memory_limit_mib") is not None:
            body["memory_limit_mib"] = first["memory_limit_mib"]
        status, made = await router.spawn_part(Part(host.url, len(clash), False), body, headers)
        if status != 201:
            await router.kill(host, [k["id"] for k in good])
            return status, made
        good += [{k: v for k, v in m.items() if k != "host"} for m in made]
    reply["sandboxes"] = [{**k, "host": host.url} for k in good]
    return 201, reply
