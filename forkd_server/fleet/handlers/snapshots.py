"""Snapshot routes: merged listing, create and pull by placement, the rest on a host that holds the tag;
a delete from the remote store through every host in turn."""

from __future__ import annotations

import asyncio

from ..hosts import Host, HostError
from ..router import Refusal, Router
from .base import RouterHandler, host_query
from .meta import lost_snapshots, merge_snapshots


async def _holder(router: Router, tag: str, engine: str | None = None) -> Host:
    held, _ = await router.holders(tag)
    if engine:
        held = {u: s for u, s in held.items() if s.get("engine") == engine} or held
    if not held:
        raise router.unknown("snapshot", tag)
    pinned = [u for u in router.state.hosts_of("snapshot", tag) if u in held]
    return router.hosts[(pinned or list(held))[0]]


class SnapshotsHandler(RouterHandler):
    for_users, stamps = True, ("POST",)

    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/snapshots" + host_query(self))
        merged = merge_snapshots(parts)
        merged += lost_snapshots(self.router, {s["tag"] for s in merged}, self.request.query)
        self.send(self.seen("snapshot", merged), missing=missing)

    async def post(self) -> None:
        """Create: on the host that already has the tag (it answers 409), else best-of-K by free memory."""
        body = self.json_body()
        tag = body.get("tag") if body else None
        held = (await self.router.holders(tag))[0] if isinstance(tag, str) else {}
        host = self.router.hosts[next(iter(held))] if held else self.router.place_new()
        status, reply = await self.call(host)
        self.answer_made_snapshot(host, status, reply, made=(201, 202))


class SnapshotPullHandler(RouterHandler):
    for_users = True  # DELETE is the snapshot tagged "pull"'s (its owner's); POST is admins'

    async def post(self) -> None:
        """Pull from the store onto the best host that does not hold the tag yet."""
        if self.viewer is not None:
            raise Refusal(403, "only JupyterHub admins may pull snapshots from the store here: the store is one for "
                               "all users, so a pull would hand a user anyone's pushed snapshot")
        body = self.json_body() or {}
        held = (await self.router.holders(body["tag"]))[0] if isinstance(body.get("tag"), str) else {}
        host = self.router.place_new(exclude=set(held)) if len(held) < len(self.router.up_hosts()) \
            else self.router.place_new()
        status, reply = await self.call(host)
        if status == 201 and isinstance(reply, dict) and isinstance(reply.get("tag"), str):
            self.router.state.pin("snapshot", [(reply["tag"], None)], host.url, exclusive=False)
            reply["host"] = host.url
        self.answer(status, reply)

    async def delete(self) -> None:  # the snapshot tagged "pull"
        if self.viewer is not None:
            await self.hub.own(self.viewer, "snapshot", "pull", change=True)
        await SnapshotHandler.delete(self, "pull")


class SnapshotHandler(RouterHandler):
    for_users, owned, changes = True, "snapshot", ("DELETE",)

    async def delete(self, tag: str) -> None:
        """Delete on every host that holds it."""
        held, _ = await self.router.holders(tag)
        if not held:
            raise self.router.unknown("snapshot", tag)
        answers = await asyncio.gather(*(self.call(self.router.hosts[u]) for u in held))
        for url, (status, _) in zip(held, answers):
            if status in (204, 404):
                self.router.state.unpin("snapshot", tag, url)
        status, reply = next(((s, r) for s, r in answers if s != 204), answers[0])
        self.answer(status, reply)


class SnapshotInfoHandler(RouterHandler):
    for_users, owned = True, "snapshot"

    async def get(self, tag: str) -> None:
        host = await _holder(self.router, tag)
        status, reply = await self.call(host)
        if isinstance(reply, dict) and status == 200:
            reply["host"] = host.url
            if self.viewer is not None:  # what came of it is the caller's to see only where it is theirs
                await self._keep_to_caller(reply, host)
        self.answer(status, reply)

    async def _keep_to_caller(self, info: dict, host: Host) -> None:
        try:
            sandboxes, snapshots = await asyncio.gather(
                *(host.get_json(path, self.router.settings.host_timeout) for path in ("/v1/sandboxes", "/v1/snapshots")))
        except HostError as exc:
            raise Refusal(502, str(exc), host=host.url) from None
        mine = {s["id"] for s in self.seen("sandbox", sandboxes)}
        seen = {s["tag"] for s in self.seen("snapshot", snapshots)}
        info["sandboxes"] = [i for i in info.get("sandboxes") or () if i in mine]
        info["descendants"] = [t for t in info.get("descendants") or () if t in seen]


class SnapshotCompactHandler(RouterHandler):
    for_users, owned, stamps = True, "snapshot", ("POST",)  # a copy of what the caller sees is theirs

    async def post(self, tag: str) -> None:
        host = await _holder(self.router, tag)
        status, reply = await self.call(host)
        self.answer_made_snapshot(host, status, reply, made=(200, 201))


class SnapshotPushHandler(RouterHandler):
    for_users, owned, changes = True, "snapshot", ("POST",)

    async def post(self, tag: str) -> None:
        await self.forward(await _holder(self.router, tag, engine="vm"))


class SnapshotShareHandler(RouterHandler):
    """``POST`` shares a snapshot with every user (``forkd.shared=true``), ``DELETE`` takes the share
    back: on every host that holds it. Admins only under JupyterHub."""

    admin_only = "only admins share snapshots or take a share back"

    async def post(self, tag: str) -> None:
        held, _ = await self.router.holders(tag)
        if not held:
            raise self.router.unknown("snapshot", tag)
        answers = await asyncio.gather(*(self.call(self.router.hosts[u]) for u in held))
        status, reply = next(((s, r) for s, r in answers if s != 200), answers[0])
        if status == 200 and isinstance(reply, dict):
            reply.update(host=next(iter(held)), hosts=list(held))
            self.seen("snapshot", [reply])
        self.answer(status, reply)

    delete = post


class StoreSnapshotHandler(RouterHandler):
    admin_only = "the store is one for all users: a delete would take away anyone's pushed snapshot"

    async def delete(self, name: str) -> None:
        """``DELETE /v1/store/snapshots/{tag|digest}``: every up host in turn. Hosts usually share one
        store: the first deletes the snapshot there, the others find it gone (404) and stop marking
        their copies ``remote``; a host with a store of its own deletes it there too; one without a
        store refuses (400). In turn, not at once: two sweeps of one store would race."""
        hosts = self.router.up_hosts()
        if not hosts:
            raise Refusal(503, "no host of the fleet is up to reach the store\nsee GET /v1/fleet/hosts for why each "
                               "is down")
        answers = []
        for host in hosts:
            try:
                answers.append((host.url, *await self.call(host)))
            except Refusal as exc:  # a host that could not be reached: the others are asked still
                answers.append((host.url, exc.status, {"error": exc.message, **exc.fields}))
        status, reply = store_delete_answer(answers)
        self.answer(status, reply)


def store_delete_answer(answers: list[tuple[str, int, object]]) -> tuple[int, object]:
    """One answer for the hosts' (url, status, body): a host that failed (5xx, with its ``host``), else
    the delete (200, with the ``hosts`` that deleted it), else a 404 (no store holds it), else the
    first (a bad reference, or no host has a store: each host says the same)."""
    def with_host(url: str, body: object, **more) -> object:
        return {**body, "host": url, **more} if isinstance(body, dict) else body

    failed = [(u, s, b) for u, s, b in answers if s >= 500]
    if failed:
        url, status, body = failed[0]
        deleted = [u for u, s, _ in answers if s == 200]
        return status, with_host(url, body, **({"deleted_by": deleted} if deleted else {}))
    done = [(u, b) for u, s, b in answers if s == 200]
    if done:
        return 200, with_host(done[0][0], done[0][1], hosts=[u for u, _ in done])
    _, status, body = ([a for a in answers if a[1] == 404] or answers)[0]
    return status, body
