"""The router as a JupyterHub service (``forkd router --hub``): the Hub vouches for every caller, and
the router keeps each user to what they own across all hosts.

The router speaks to every host with the hosts' token, which a host takes for an operator's, so the
hosts apply no ownership of their own: the router applies forkd's rule (``hub/ownership.py``, the
one ``forkd serve --hub`` applies) to what it passes on.

- **Who**: ``hub/gate.py`` asks the Hub whose a token is and whether it holds the service's scope;
  the router's own ``--token-file`` token is an operator's (sees all, stamps nothing).
- **Owner**: a request that makes something (spawn, create, branch, fork) has the caller's
  ``forkd.owner`` set in its body before a host sees it; a user's ``forkd.`` labels are refused 403.
- **404**: a call about a sandbox, snapshot or workspace the caller does not see answers 404 with
  the words an unknown one gets; one that would change a shared snapshot, 403.
- **Views**: lists, the tree and the event stream carry only what the caller sees. An event's
  object is looked up by its labels, kept (``hub/events.KeptLabels``) from the router's listings
  and replies, or asked of its host when a stream first shows it.
- **Kept labels**: a sandbox's or workspace's labels as its host gave them (in a listing, a reply,
  an ``updated`` event, which carries them) decide a call about it without asking the host again;
  only an admin can change an owner, and the host's event says so at once (a stream that broke is
  followed by a fresh listing of that host).

Routes a handler does not declare fit for users (``RouterHandler.for_users``) are for admins only.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

from ..hub.events import KeptLabels, event_key
from ..hub.gate import HubGate
from ..hub.ownership import Caller, Refused, holders_labels
from .hosts import HostError
from .router import Refusal, Router

PATHS = {"sandbox": "/v1/sandboxes/{}", "workspace": "/v1/workspaces/{}", "snapshot": "/v1/snapshots/{}/info",
         "kernel": "/v1/kernels/{}"}
KEYS = {"sandbox": "id", "snapshot": "tag", "workspace": "name"}


class RouterHub:
    def __init__(self, router: Router, token: str | None):
        self.router = router
        self.gate = HubGate(token)
        self.kept = KeptLabels()
        self._asking: dict[tuple[str, str], asyncio.Future] = {}
        router.listed = self.learn
        learn_event = router.events.on_event

        def on_event(host, event):  # before the router unpins what ended: its labels stay known
            self.noticed(host, event)
            if learn_event is not None:
                learn_event(host, event)
        router.events.on_event = on_event

    # --- who calls ----------------------------------------------------------------------------------

    async def admit(self, handler) -> Caller | None:
        """The caller of ``handler``'s request, checked against its route's policy; None for the
        operator (the router's own token). Refusal otherwise."""
        try:
            user = await self.gate.user(handler, handler.auth_resource)
        except Refused as exc:
            raise Refusal(exc.status, exc.message) from None
        if user.operator:
            return None
        caller = Caller(user.username, admin=user.admin)
        if not caller.admin:
            if not handler.for_users or handler.admin_only:
                raise Refusal(403, f"only JupyterHub admins may use {handler.request.method} "
                                   f"{handler.request.path} through the router"
                              + (f": {handler.admin_only}" if handler.admin_only else
                                 " (it is not kept to each user's own objects yet)"))
            method = handler.request.method
            if handler.owned and handler.path_args:
                await self.own(caller, handler.owned, handler.path_args[0], change=method in handler.changes,
                               creating=method in handler.creates)
            for named_by, kind, field in handler.body_owns:  # a spawn's snapshot, a kernel's HEAD
                body = handler.json_body() if named_by == method else None
                if body is not None and isinstance(body.get(field), str):
                    await self.own(caller, kind, body[field])
        if handler.request.method in handler.stamps:
            self.stamp(handler, caller)
        elif handler.request.method in handler.checks_labels:
            body = handler.json_body()
            gone = body.get("remove_labels") if body else None  # a server label is no more theirs to take off
            try:
                caller.check_labels(body.get("labels") if body and isinstance(body.get("labels"), dict) else None)
                caller.check_labels(dict.fromkeys(gone, "") if isinstance(gone, list) and
                                    all(isinstance(k, str) for k in gone) else None)
            except Refused as exc:
                raise Refusal(exc.status, exc.message) from None
        return caller

    def stamp(self, handler, caller: Caller) -> None:
        """Set the caller's owner label in the request's body (a body a host would refuse anyway,
        one that is no JSON object or whose labels are no object, is passed on as it is)."""
        body = handler.json_body()
        if body is None or not isinstance(body.get("labels", {}), (dict, type(None))):
            return
        try:
            body["labels"] = caller.stamp(body.get("labels"))
        except Refused as exc:
            raise Refusal(exc.status, exc.message) from None
        handler.request.body = json.dumps(body).encode()

    # --- what the caller may touch --------------------------------------------------------------------

    async def own(self, caller: Caller, kind: str, key: str, *, change: bool = False, creating: bool = False) -> None:
        """Refusal 404 (the words an unknown one gets) unless ``caller`` sees ``kind`` ``key``; 403 when
        ``change`` and it is a shared snapshot. A host that is down or an object that ended answers
        its owner as the router would anyone without Hub (410, the 404 saying how it ended). A
        kernel's record is its HEAD's owner's; ``creating``: a kernel no host has yet is anyone's to make."""
        if caller.admin:
            return
        if kind == "kernel":
            await self.own_kernel(caller, key, creating)
            return
        labels, why = await self.labels_now(kind, key)
        try:
            caller.check(kind, key, labels, change=change)
        except Refused as exc:
            if exc.status == 404:
                raise self.router.unknown(kind, key) from None
            raise Refusal(exc.status, exc.message) from None
        if why is not None:  # theirs, but lost or ended: say so as the router does
            raise why

    async def own_kernel(self, caller: Caller, kernel_id: str, creating: bool) -> None:
        """A kernel's record is seen by whoever sees its HEAD, running or ended (its labels as last
        known); anyone else gets the 404 of an unknown kernel."""
        try:
            host = await self.router.locate("kernel", kernel_id)
        except Refusal as refusal:
            if refusal.status == 404 and creating:
                return
            raise self.router.unknown("kernel", kernel_id) if refusal.status == 404 else refusal from None
        status, record = await self.ask(host, "kernel", kernel_id)
        if status == 404 and creating:
            return
        head = record.get("head") if status == 200 and isinstance(record, dict) else None
        labels = (await self.labels_now("sandbox", head))[0] if isinstance(head, str) else None
        if not caller.sees(labels):
            raise self.router.unknown("kernel", kernel_id)

    async def labels_now(self, kind: str, key: str) -> tuple[dict | None, Refusal | None]:
        """The labels of ``kind`` ``key`` as its host has them now (None: there is no such object),
        and the refusal the router gives for it if it is lost or ended (its labels then are the
        last ones known)."""
        if kind == "snapshot":
            held, _ = await self.router.holders(key)
            if held:
                labels = holders_labels(list(held.values()))
                self.kept.keep(("snapshot", key), labels)
                return labels, None
            lost = next((r for r in self.router.lost_records("snapshot") if r["tag"] == key), None)
            if lost is not None:
                return lost.get("labels") or {}, None  # the route itself says it is lost
            return None, None
        try:
            host = await self.router.locate(kind, key)
        except Refusal as refusal:
            known = self.kept.get((kind, key))
            if refusal.status == 410 and known is None:
                known = next((r.get("labels") or {} for r in self.router.lost_records(kind) if r.get("id") == key), None)
            return (known, refusal) if refusal.status in (404, 410) else (None, refusal)
        known = self.kept.get((kind, key, host.url))
        if known is not None:  # as its host gave them (an ended one: the host's own 404 tells its owner how)
            return known, None
        status, info = await self.ask(host, kind, key)
        if status == 200 and isinstance(info, dict):
            labels = info.get("labels") or {}
            self.keep(kind, key, labels, host.url)
            return labels, None
        if status == 404:  # it ended meanwhile: its owner hears how, from the host
            fields = info if isinstance(info, dict) else {}
            return self.kept.get((kind, key)), Refusal(404, fields.get("error", f"{kind} {key} not found"),
                                                         **{k: v for k, v in fields.items() if k != "error"})
        raise Refusal(status if status >= 400 else 502, f"host {host.url} answered {status} when asked whose {kind} "
                                                        f"{key} is: {_error(info)}", host=host.url)

    async def ask(self, host, kind: str, key: str) -> tuple[int, Any]:
        try:
            return await host.request_json("GET", PATHS[kind].format(quote(key, safe="")),
                                           timeout=self.router.settings.host_timeout)
        except HostError as exc:
            raise Refusal(502, f"{exc}\nthe router marks a host down after {self.router.settings.down_after:g} s "
                               f"without a good heartbeat", host=host.url) from None

    # --- what the caller sees -------------------------------------------------------------------------

    def keep(self, kind: str, key: str, labels: dict, host: str | None = None) -> None:
        """Keep an object's labels: by (kind, key) for events, and by (kind, key, host) where its
        host gave them, for calls about it (``labels_now``)."""
        self.kept.keep((kind, key), labels)
        if host is not None and kind != "snapshot":
            self.kept.keep((kind, key, host), labels)

    def learn(self, kind: str, items: list, host: str | None = None) -> None:
        """Keep the labels of listed or made objects (sandboxes, snapshots, workspaces, tree nodes),
        each from ``host`` or the ``host`` the router gave it."""
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("labels", {}), dict):
                continue
            k = item.get("kind", kind) if kind == "node" else kind
            key = item.get(KEYS.get(k, "id")) if kind != "node" else item.get("id")
            if isinstance(key, str) and k in KEYS and item.get("status") != "lost":
                where = host or item.get("host")
                self.keep(k, key, item.get("labels") or {}, where if isinstance(where, str) else None)

    async def kernels_visible(self, caller: Caller | None, records: list) -> list:
        """The kernel records ``caller`` sees: those whose HEAD they see (running, or ended with its
        labels known to the router)."""
        if caller is None or caller.admin:
            return records
        parts, _ = await self.router.gather_lists("/v1/sandboxes")
        self.learn("sandbox", [i for _, items in parts for i in items])
        return [r for r in records if isinstance(r, dict) and isinstance(r.get("head"), str)
                and caller.sees(self.kept.get(("sandbox", r["head"])))]

    def visible(self, caller: Caller | None, kind: str, items: list) -> list:
        """What of ``items`` (sandboxes, snapshots, workspaces or tree ``node``s) ``caller`` sees."""
        self.learn(kind, items)
        if caller is None or caller.admin:
            return items
        if kind == "node":
            return caller.tree(items)
        return [i for i in items if isinstance(i, dict) and caller.sees(i.get("labels"), snapshot=kind == "snapshot")]

    # --- events -------------------------------------------------------------------------------------------

    def noticed(self, host, event: dict) -> None:
        """A host's event, before it is passed on: one that carries labels (a PATCH, a fork tree
        decided) updates the kept ones. (What a host makes is learnt from the router's replies and
        listings, or asked for when a stream first shows it: not on every creation, which would be a
        read of the host per child of a spawn.)"""
        key = event_key(event)
        if key is not None and key[0] in KEYS and isinstance(event.get("labels"), dict):
            self.keep(*key, event["labels"], host.url)

    async def event_visible(self, caller: Caller, event: dict) -> bool:
        """May ``caller`` see ``event``? Its object's labels, as kept or asked of its host; a kernel
        is seen by whoever sees its HEAD; the router's own host events are for admins."""
        if caller.admin:
            return True
        key = event_key(event)
        if key is None:
            return False
        kind, name = key
        if kind == "kernel":
            head = event.get("head")
            labels = self.kept.get(key)
            if labels is None and isinstance(head, str):
                labels = await self._labels_of(event.get("host"), "sandbox", head)
                if labels is not None:
                    self.kept.keep(key, labels)
        elif self.kept.get(key) is not None or event.get("action") in ("killed", "deleted", "lost"):
            labels = self.kept.get(key)
        else:
            labels = await self._labels_of(event.get("host"), kind, name)
        return labels is not None and caller.sees(labels, snapshot=kind == "snapshot")

    async def _labels_of(self, url: str | None, kind: str, key: str) -> dict | None:
        """The labels of an object, kept or asked of host ``url`` once however many want them."""
        known = self.kept.get((kind, key))
        host = self.router.hosts.get(url or "")
        if known is not None or host is None or not host.up or kind not in PATHS:
            return known
        pending = self._asking.get((kind, key))
        if pending is None:
            pending = self._asking[(kind, key)] = asyncio.ensure_future(self.ask(host, kind, key))
            pending.add_done_callback(lambda _f: self._asking.pop((kind, key), None))
        try:
            status, info = await asyncio.shield(pending)
        except Refusal:
            return None
        if status == 200 and isinstance(info, dict):
            self.keep(kind, key, info.get("labels") or {}, host.url)
        return self.kept.get((kind, key))


def _error(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return repr(body)[:200]
