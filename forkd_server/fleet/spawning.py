"""A spawn placed on the fleet: ``spawn(tag, n)`` for the spawn route and for a fork tree whose
children span hosts (forks.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from .router import Router


async def spawn_placed(router: Router, tag: str, n: int, body: dict, headers: dict) -> tuple[int, Any]:
    """Placement (placement.py), a pull first where a VM snapshot must move, the parts side by side:
    (201, the children, each with its ``host``) or, if one part fails, its answer with the other
    parts killed (all or nothing), unless placing again may help: once on fresh listings when a host
    refused a part of a plan made from the kept ones (404, 409: they trailed the host), once without
    a host that was full (503). Raises Refusal when the fleet cannot take ``n``."""
    fresh, full_seen = False, False
    while True:
        parts, holders, kept = await router.plan_spawn(tag, n, fresh)
        for part in parts:
            if part.pull:
                await router.ensure_pulled(router.hosts[part.host], tag, holders)
        answers = await asyncio.gather(*(router.spawn_part(p, body, headers) for p in parts))
        failed = next(((p, s, r) for p, (s, r) in zip(parts, answers) if s != 201), None)
        if failed is None:
            return 201, [kid for _, kids in answers for kid in kids]
        await asyncio.gather(*(router.kill(router.hosts[p.host], [k["id"] for k in r])
                               for p, (s, r) in zip(parts, answers) if s == 201))
        part, status, reply = failed
        if kept and status in (404, 409):
            fresh = True  # a snapshot event was still on its way: place again on what the hosts list now
            continue
        if status == 503 and not full_seen and router.hosts[part.host].capacity is not None:
            full_seen = True
            router.hosts[part.host].full()  # its figure was stale: place again without it
            continue
        return status, reply
