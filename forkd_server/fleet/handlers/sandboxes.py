"""Sandbox routes: merged listing, spawn by placement, and every call about one sandbox on its host."""

from __future__ import annotations

import math

from ...controller.checks import MAX_CHILDREN
from ..forks import fork_across, fork_fields, room_for, settle_children
from ..hosts import Host, HostError
from ..promotes import promote_across, spanned_tree
from ..router import Refusal
from ..spawning import spawn_placed
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
        """Spawn: placement across the fleet (spawning.py); a host says what is wrong with a bad body."""
        body = self.json_body()
        n = _count(body.get("n")) if body else None
        if body is None or not isinstance(body.get("snapshot_tag"), str) or n is None:
            await self.forward(self.router.place_new())
            return
        status, reply = await spawn_placed(self.router, body["snapshot_tag"], n, body, self.client_headers())
        if status != 201:
            self.answer(status, reply)
            return
        self.send(self.seen("sandbox", reply), 201)


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
    """A fork tree (branch once, spawn N children of it). On the sandbox's host when it has room for
    N: the snapshot and the children are pinned there, each child under an id no other host uses.
    Else, for a VM-engine sandbox, across hosts: the branch on its host, the children placed as a
    spawn's are; a process-engine one is refused, saying why (forks.py)."""

    stamps = ("POST",)

    async def post(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        fork = fork_fields(self.json_body())
        room = await room_for(self.router, host, fork["count"]) if fork else None
        if room is not None:
            status, reply = await self._across(host, sandbox_id, fork, room)
        else:
            status, reply = await self.call(host)
            if status == 503 and fork and isinstance(reply, dict) and "capacity" in reply:
                await self.router.refresh_capacity(host)  # its figure was stale: the fork spans hosts after all
                status, reply = await self._across(host, sandbox_id, fork, _room(reply["capacity"]))
            elif status == 201 and isinstance(reply, dict):
                status, reply = await self._on_host(host, reply)
        if status == 201:  # under JupyterHub: whose each is, kept for calls and events (hub.py)
            self.seen("sandbox", reply.get("sandboxes") or [])
            if isinstance(reply.get("snapshot"), dict):
                self.seen("snapshot", [reply["snapshot"]])
        self.answer(status, reply)

    async def _across(self, host: Host, sandbox_id: str, fork: dict, room: int):
        try:
            return await fork_across(self.router, host, sandbox_id, fork, room, self.client_headers())
        except HostError as exc:
            raise Refusal(502, f"fork of {sandbox_id} across hosts: {exc}", host=exc.host) from None

    async def _on_host(self, host: Host, reply: dict):
        snap = reply.get("snapshot")
        if isinstance(snap, dict) and isinstance(snap.get("tag"), str):
            self.router.state.pin("snapshot", [(snap["tag"], None)], host.url, exclusive=False)
            snap["host"] = host.url
        return await settle_children(self.router, host, reply, self.client_headers())


class PromoteHandler(PinnedHandler):
    """The winner of a fork tree: its host promotes a tree of its own; the router one that spans hosts."""

    async def post(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        body = self.json_body()
        spanned = spanned_tree(self.router, sandbox_id, body)
        cleanup = (body or {}).get("cleanup_siblings", True)
        bad = (body is None and (self.request.body or b"").strip()) or set(body or ()) - {"tree_id", "cleanup_siblings"}
        if spanned is None or not isinstance(cleanup, bool) or bad:
            await self.forward(host)  # a host says what is wrong with a bad body
            return
        status, reply = await promote_across(self.router, sandbox_id, spanned[0], cleanup, self.client_headers())
        self.answer(status, reply)


def _room(capacity) -> int:
    """The children a host refusing a fork over its cap had room for (its 503's ``capacity``)."""
    held, cap = (capacity.get(k) if isinstance(capacity, dict) else None for k in ("sandboxes", "max_sandboxes"))
    return max(0, cap - held) if isinstance(held, int) and isinstance(cap, int) else 0
