"""``/v1/kernels``: where each forkd kernel's HEAD is (the forkd kernel writes it, panels read it),
and moving it (``checkout``: what the panel's "Check out" does, for clients outside the notebook)."""

from __future__ import annotations

import queue
import re
import time

from jupyter_server.auth.decorator import authorized
from tornado import web

from .handlers import ApiError, ForkdHandler
from .hub.ownership import OWNER

KERNEL_HEAD = {"head": ("string", True), "notebook": ("string", False), "base_snapshot": ("string", False),
               "engine": ("string", False)}


class KernelsHandler(ForkdHandler):
    auth_resource = "forkd:kernels"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        records = await self.call(self.app.kernels.list)
        if self.viewer is not None:  # a kernel is seen by whoever sees its HEAD, running or ended
            mine = {s["id"] for s in await self.call(self.controller.list_sandboxes, {OWNER: self.viewer.name})}
            ended = self.controller.registry.ended_sandbox
            records = [r for r in records if r["head"] in mine
                       or self.viewer.sees((await self.call(ended, r["head"]) or {}).get("labels"))]
        self.send(records)


async def own_kernel(handler: ForkdHandler, kernel_id: str) -> None:
    """Under JupyterHub, a kernel's record is its HEAD's owner's: 404 for anyone else."""
    if handler.viewer is None:
        return
    try:
        record = await handler.call(handler.app.kernels.get, kernel_id)
        await handler.own("sandbox", record["head"], gone_ok=True)  # a restarted kernel finds where it was
    except ApiError as exc:
        if exc.status_code == 404:
            raise ApiError(404, f"kernel {kernel_id} not found") from None
        raise


class KernelHandler(ForkdHandler):
    auth_resource = "forkd:kernels"
    body_spec = KERNEL_HEAD  # the JSON body of put

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        await own_kernel(self, kernel_id)
        self.send(await self.call(self.app.kernels.get, kernel_id))

    @web.authenticated
    @authorized(action="write")
    async def put(self, kernel_id: str) -> None:
        body = self.body(self.body_spec)
        if self.viewer is not None:
            if kernel_id in {r["kernel_id"] for r in await self.call(self.app.kernels.list)}:
                await own_kernel(self, kernel_id)
            await self.own("sandbox", body["head"])
        self.send(await self.call(self.app.kernels.set_head, kernel_id, body["head"], notebook=body.get("notebook"),
                                  base_snapshot=body.get("base_snapshot"), engine=body.get("engine")))

    @web.authenticated
    @authorized(action="write")
    async def delete(self, kernel_id: str) -> None:
        await own_kernel(self, kernel_id)
        await self.call(self.app.kernels.forget, kernel_id)
        self.no_content()


class KernelLeaveHandler(ForkdHandler):
    """``POST /v1/kernels/{id}/leave``: the kernel stops with its Jupyter server. Its record goes,
    its notebook's HEAD is kept for the notebook's next kernel (its ``PUT`` answers ``left``), and
    its sandboxes keep running. What a Jupyter server in remote or router mode calls as it stops,
    for its own forkd kernels (a local one does it in-process)."""

    auth_resource = "forkd:kernels"

    @web.authenticated
    @authorized(action="write")
    async def post(self, kernel_id: str) -> None:
        await own_kernel(self, kernel_id)
        if not await self.call(self.app.kernels.leave, kernel_id):
            raise ApiError(404, f"kernel {kernel_id} not found (it never registered, or it shut down)")
        self.no_content()


class KernelsLeftHandler(ForkdHandler):
    """``DELETE /v1/kernels-left?notebook=PATH[&head=SB]``: take a notebook's left HEAD (200 with it,
    404 if none), so this server does not tell it again: what a fleet's router calls on the host of
    that HEAD once it told the notebook's next kernel, which landed on another host."""

    auth_resource = "forkd:kernels"

    @web.authenticated
    @authorized(action="write")
    async def delete(self) -> None:
        notebook, head = self.get_query_argument("notebook", ""), self.get_query_argument("head", "") or None
        if self.viewer is not None:  # under JupyterHub: only a left HEAD the caller sees
            if head is None:
                raise ApiError(400, "head is required: the left HEAD to take (a sandbox id you own)")
            await self.own("sandbox", head, gone_ok=True)
        taken = await self.call(self.app.kernels.take_left, notebook, head)
        if taken is None:
            raise ApiError(404, f"notebook {notebook!r} has no left HEAD here" + (f" that is {head}" if head else ""))
        self.send(taken)


CHECKOUT = {"sandbox": ("string", True)}
CHECKOUT_WAIT = 60.0  # seconds the kernel may take to reach the line (it runs after the cell it is running)
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # what goes into a %forkd line as it is


class KernelCheckoutHandler(ForkdHandler):
    """``POST /v1/kernels/{id}/checkout {"sandbox"}``: move a notebook to a sandbox, as the panel's
    "Check out" does: ``%forkd checkout`` run in the notebook's kernel (so it happens between cells,
    and the kernel, which owns HEAD, moves it). Only for a kernel this Jupyter server runs."""

    auth_resource = "forkd:kernels"
    body_spec = CHECKOUT

    @web.authenticated
    @authorized(action="execute")
    async def post(self, kernel_id: str) -> None:
        target = self.body(self.body_spec)["sandbox"]
        if not SAFE_ID.match(target):
            raise ApiError(400, f"{target!r} is not a sandbox id\nlist_sandboxes (GET /v1/sandboxes) names them")
        await own_kernel(self, kernel_id)
        record = await self.call(self.app.kernels.get, kernel_id)
        await self.own("sandbox", target)
        await self.call(self.controller.get_sandbox, target)  # 404 saying how it ended, before the kernel
        await checkout_in_kernel(self.serverapp.kernel_manager, kernel_id, target, record.get("notebook"))
        self.send(await self.call(self.app.kernels.get, kernel_id))


async def checkout_in_kernel(manager, kernel_id: str, target: str, notebook: str | None) -> None:
    """``%forkd checkout target`` run in kernel ``kernel_id`` of this Jupyter server (``manager``);
    ApiError 409 saying why when it is not one of its kernels, a cell holds it, or it refused. Also
    the checkout of a Jupyter server in router mode (fleet/extension.py), whose kernels it runs."""
    if kernel_id not in manager.list_kernel_ids():
        raise ApiError(409, f"the kernel of {notebook or kernel_id} does not run in this Jupyter "
                            f"server\nrun `%forkd checkout {target}` in the notebook itself")
    content = await run_line(manager.get_kernel(kernel_id), f"%forkd checkout {target}", CHECKOUT_WAIT)
    if content is None:
        raise ApiError(409, f"the kernel of {notebook or kernel_id} did not reach the checkout "
                            f"within {CHECKOUT_WAIT:g} s: a cell is running\nthe checkout is queued and happens "
                            f"when the cell ends; interrupt the cell to have it now")
    if content.get("status") != "ok":
        raise ApiError(409, f"the notebook's kernel refused the checkout: {content.get('evalue') or content}")


async def run_line(kernel, code: str, timeout: float) -> dict | None:
    """Run ``code`` silently in a kernel this server manages; its execute_reply's content, or None
    if it did not come within ``timeout`` (the request stays queued in the kernel)."""
    client = kernel.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False, stop_on_error=False)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await client.get_shell_msg(timeout=left)
            except (TimeoutError, queue.Empty):
                return None
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return reply["content"]
        return None
    finally:
        client.stop_channels()
