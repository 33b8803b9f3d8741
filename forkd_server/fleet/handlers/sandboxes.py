"""Sandbox routes: merged listing, spawn by placement, and every call about one sandbox on its host."""

from __future__ import annotations

import asyncio
import math

from ...checks import MAX_CHILDREN
from ..forks import settle_children
from ..hosts import Host
from .base import RouterHandler, host_query
from .meta import labels_match


def _count(value) -> int | None:
    """``n`` of a spawn when it is one a host takes (1 to MAX_CHILDREN), else None (a host says why)."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if value == int(value) and 1 <= value <= MAX_CHILDREN else None


class SandboxesHandler(RouterHandler):
    for_users, stamps = True, ("POST",)
    body_owns = (("POST", "snapshot", "snapshot_tag"),)  # a snapshot of the caller's, or a shared one

    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/sandboxes" + host_query(self))
        items = [{**i, "host": h.url} for h, items in parts for i in items if isinstance(i, dict)]
        items += [r for r in self.router.lost_records("sandbox") if labels_match(r, self.request.query)]
        self.send(self.seen("sandbox", items), missing=missing)

    async def post(self) -> None:
        """Spawn: placement (placement.py), a pull first where a VM snapshot must move, the parts
        side by side; if one part fails the others are killed and its answer is the reply, unless
        placing again may help: once on fresh listings when a host refused a part of a plan made from
        the kept ones (404, 409: they trailed the host), once without a host that was full (503)."""
        router = self.router
        body = self.json_body()
        n = _count(body.get("n")) if body else None
        if body is None or not isinstance(body.get("snapshot_tag"), str) or n is None:
            await self.forward(router.place_new())  # a host says exactly what is wrong with it
            return
        tag = body["snapshot_tag"]
        fresh, full_seen = False, False
        while True:
            parts, holders, kept = await router.plan_spawn(tag, n, fresh)
            for part in parts:
                if part.pull:
                    await router.ensure_pulled(router.hosts[part.host], tag, holders)
            answers = await asyncio.gather(*(router.spawn_part(p, body, self.client_headers()) for p in parts))
            failed = next(((p, s, r) for p, (s, r) in zip(parts, answers) if s != 201), None)
            if failed is None:
                break
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
            self.answer(status, reply)
            return
        self.send(self.seen("sandbox", [kid for _, kids in answers for kid in kids]), 201)


class PinnedHandler(RouterHandler):
    """A call about one sandbox (workspace, kernel): to the host it is pinned to, as it streams."""

    kind = "sandbox"
    for_users, owned = True, "sandbox"

    async def locate(self, key: str) -> Host:
        return await self.router.locate(self.kind, key)

    async def get(self, key: str, *_) -> None:
        await self.forward(await self.locate(key))

    post = put = patch = get

    async def delete(self, key: str, *_) -> None:
        await self.forward(await self.locate(key))


class SandboxHandler(PinnedHandler):
    checks_labels = ("PATCH",)

    async def get(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        if status == 200 and isinstance(reply, dict):
            reply["host"] = host.url
        elif status == 404:
            self.router.state.unpin("sandbox", sandbox_id, host.url)
        self.answer(status, reply)

    async def delete(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        if status in (204, 404):
            self.router.state.unpin("sandbox", sandbox_id, host.url)
        self.answer(status, reply)


class BranchHandler(PinnedHandler):
    """Branch on the sandbox's host; the new snapshot is pinned there."""

    stamps = ("POST",)

    async def post(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        self.answer_made_snapshot(host, status, reply, made=(201, 202))


class ForkHandler(PinnedHandler):
    """A fork tree (branch once, spawn N children of it) on the sandbox's host: the snapshot and the
    children are pinned there, each child under an id no other host uses (forks.py)."""

    stamps = ("POST",)

    async def post(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        if status == 201 and isinstance(reply, dict):
            snap = reply.get("snapshot")
            if isinstance(snap, dict) and isinstance(snap.get("tag"), str):
                self.router.state.pin("snapshot", [(snap["tag"], None)], host.url, exclusive=False)
                snap["host"] = host.url
            status, reply = await settle_children(self.router, host, reply, self.client_headers())
            if status == 201:  # under JupyterHub: whose each is, kept for calls and events (hub.py)
                self.seen("sandbox", reply.get("sandboxes") or [])
                if isinstance(snap, dict):
                    self.seen("snapshot", [snap])
        self.answer(status, reply)
