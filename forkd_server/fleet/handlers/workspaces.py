"""Workspace and forkd kernel routes: merged listings, the rest on the host each is pinned to."""

from __future__ import annotations

import asyncio

from .. import left
from ..hosts import HostError
from ..router import Refusal
from .base import RouterHandler
from .sandboxes import PinnedHandler
from .snapshots import _holder


class WorkspacesHandler(RouterHandler):
    for_users, stamps = True, ("POST",)
    body_owns = (("POST", "snapshot", "snapshot_tag"),)

    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/workspaces")
        items = [{**i, "host": h.url} for h, items in parts for i in items if isinstance(i, dict)]
        self.send(self.seen("workspace", items), missing=missing)

    async def post(self) -> None:
        body = self.json_body() or {}
        tag = body.get("snapshot_tag")
        host = await _holder(self.router, tag) if isinstance(tag, str) else self.router.place_new()
        status, reply = await self.call(host)
        if status == 201 and isinstance(reply, dict) and isinstance(reply.get("name"), str):
            self.router.state.pin("workspace", [(reply["name"], reply)], host.url)
            reply["host"] = host.url
            self.seen("workspace", [reply])
        self.answer(status, reply)


class WorkspaceHandler(PinnedHandler):
    kind = "workspace"
    owned = "workspace"

    async def delete(self, name: str) -> None:
        host = await self.locate(name)
        status, reply = await self.call(host)
        if status in (204, 404):
            self.router.state.unpin("workspace", name, host.url)
        self.answer(status, reply)


class KernelsHandler(RouterHandler):
    for_users = True

    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/kernels")
        records = [{**i, "host": h.url} for h, items in parts for i in items if isinstance(i, dict)]
        if self.hub is not None:  # under JupyterHub: the kernels whose HEAD the caller sees
            records = await self.hub.kernels_visible(self.caller, records)
        self.send(records, missing=missing)


class KernelHandler(PinnedHandler):
    """A forkd kernel's record lives on the host of its HEAD sandbox: PUT (and checkout) go there."""

    kind = "kernel"
    owned, creates = "kernel", ("PUT",)  # a record is its HEAD's owner's; PUT may make one
    body_owns = (("PUT", "sandbox", "head"), ("POST", "sandbox", "sandbox"))  # HEAD, or checkout's target

    async def put(self, kernel_id: str, *_) -> None:
        body = self.json_body() or {}
        sandbox = body.get("head") if self.request.method == "PUT" else body.get("sandbox")
        if not isinstance(sandbox, str):
            await self.forward(await self.locate(kernel_id))
            return
        host = await self.router.locate("sandbox", sandbox)
        self.router.state.pin("kernel", [(kernel_id, None)], host.url)
        notebook = body.get("notebook") if self.request.method == "PUT" else None
        if not isinstance(notebook, str) or not notebook:
            await self.forward(host)
            return
        status, reply = await self.call(host)
        if status == 200 and isinstance(reply, dict):  # where its last kernel left it, on any host
            await left.tell(self.router, host, notebook, self.caller, reply)
        self.answer(status, reply)

    post = put

    async def delete(self, kernel_id: str) -> None:
        host = await self.locate(kernel_id)
        status, reply = await self.call(host)
        if status in (204, 404):
            self.router.state.unpin("kernel", kernel_id, host.url)
        self.answer(status, reply)


class KernelLeaveHandler(KernelHandler):
    """``POST /v1/kernels/{id}/leave`` on the host of the record, which keeps the notebook's HEAD;
    the router keeps a copy, so the notebook's next kernel is told on any host (fleet/left.py)."""

    body_owns = ()

    async def post(self, kernel_id: str) -> None:
        host = await self.locate(kernel_id)
        try:
            status, reply = await left.leave(self.router, host, kernel_id, self.caller, self.client_headers())
        except HostError as exc:
            raise Refusal(502, f"{exc}\nthe router marks a host down after {self.router.settings.down_after:g} s "
                               f"without a good heartbeat", host=host.url) from None
        if status in (204, 404):
            self.router.state.unpin("kernel", kernel_id, host.url)
        self.answer(status, reply)


class KernelsLeftHandler(RouterHandler):
    """``DELETE /v1/kernels-left?notebook=``: the notebook's left HEAD taken on every host that is up
    (and the router's copy), the first found answered; 404 if none had it."""

    async def delete(self) -> None:
        notebook = self.get_query_argument("notebook", "")
        if not notebook:
            raise Refusal(400, "notebook is required: the notebook path whose left HEAD to take")
        self.router.state.take(left.KIND, left.key(notebook, self.caller))
        hosts = self.router.up_hosts()
        answers = await asyncio.gather(*(self.call(h) for h in hosts), return_exceptions=True)
        taken = [(h, a[1]) for h, a in zip(hosts, answers) if isinstance(a, tuple) and a[0] == 200]
        if not taken:
            raise Refusal(404, f"notebook {notebook!r} has no left HEAD on any host that is up"
                               + self.router.not_up_note())
        host, record = taken[0]
        self.send({**record, "host": host.url})
