"""``/v1/kernels``: where each forkd kernel's HEAD is (the forkd kernel writes it, panels read it)."""

from __future__ import annotations

from jupyter_server.auth.decorator import authorized
from tornado import web

from .handlers import ForkdHandler

KERNEL_HEAD = {"head": ("string", True), "notebook": ("string", False), "base_snapshot": ("string", False),
               "engine": ("string", False)}


class KernelsHandler(ForkdHandler):
    auth_resource = "forkd:kernels"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send(await self.call(self.app.kernels.list))


class KernelHandler(ForkdHandler):
    auth_resource = "forkd:kernels"
    body_spec = KERNEL_HEAD  # the JSON body of put

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        self.send(await self.call(self.app.kernels.get, kernel_id))

    @web.authenticated
    @authorized(action="write")
    async def put(self, kernel_id: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.call(self.app.kernels.set_head, kernel_id, body["head"], notebook=body.get("notebook"),
                                  base_snapshot=body.get("base_snapshot"), engine=body.get("engine")))

    @web.authenticated
    @authorized(action="write")
    async def delete(self, kernel_id: str) -> None:
        await self.call(self.app.kernels.forget, kernel_id)
        self.no_content()
