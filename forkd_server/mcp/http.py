"""Streamable HTTP inside jupyter-server: ``{base_url}forkd/mcp`` (``/mcp`` in ``forkd serve``).

jupyter-server is tornado, not ASGI, and its auth is tornado's: so the route is a forkd handler
(the server's own token or login, 401 without one, the same authorizer and body limits as every
forkd route) that hands the authenticated request to the mcp SDK's streamable-HTTP session
manager as one ASGI call, writing what it answers (JSON, or the SSE stream that carries progress
notifications before the result) as it comes. A bridge of ~60 lines rather than a second web
server on another port: one URL, one token, one TLS setup, one place that says who may call.

The session manager runs on the server's loop from the first request until the extension stops
(``McpMount``); its
DNS-rebinding check is off because jupyter-server's own Host/Origin checks (``allow_remote_access``,
``allow_origin``) guard this route as they guard every other. The tools reach the REST API of the
server they live in through the SDK with the server's own token, so the server's limits apply; the
quickest (``eval_code``, ``ping_sandbox``) are made on the server's own controller instead, admitted
and answered as their routes are (``_in_process``).
"""

from __future__ import annotations

import asyncio
import logging

from jupyter_server.auth.decorator import authorized
from tornado import web
from tornado.iostream import StreamClosedError

from ..handlers.base import ApiError, ForkdHandler

log = logging.getLogger("forkd.mcp")
MAX_BODY = 4 << 20  # the mcp SDK's own limit for one message


def own_url(serverapp, prefix: str) -> str:
    """Where this server's forkd routes answer, from the server itself (loopback when it listens
    on every address)."""
    scheme = "https" if serverapp.certfile else "http"
    ip = serverapp.ip or "127.0.0.1"
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "[::1]"}.get(ip, ip)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{serverapp.port}{serverapp.base_url}{prefix}".rstrip("/")


def routes(prefix: str) -> list[tuple[str, type]]:
    """The MCP route, relative to base_url (``prefix`` as for ``handlers.route_table``)."""
    return [(f"/{prefix}mcp", McpHandler)]


class McpMount:
    """The MCP server and its streamable-HTTP session manager, running while the extension does."""

    def __init__(self, controller, quick=None):
        from mcp.server.transport_security import TransportSecuritySettings

        from ._server import build_server
        self.server = build_server(controller, quick)
        self.server.streamable_http_app(  # makes server.session_manager; its Starlette app stays unused
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        self.manager = self.server.session_manager
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="forkd-mcp")

    async def _run(self) -> None:
        async with self.manager.run():
            self.ready.set()
            await self._stop.wait()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()


class McpHandler(ForkdHandler):
    """POST (a message), GET (the server's stream), DELETE (end the session): the mcp SDK answers."""

    auth_resource = "forkd:mcp"
    max_body_bytes = MAX_BODY
    _gone: asyncio.Event | None = None

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        await self._bridge()

    @web.authenticated
    @authorized
    async def get(self) -> None:
        await self._bridge()

    @web.authenticated
    @authorized(action="execute")
    async def delete(self) -> None:
        await self._bridge()

    def on_connection_close(self) -> None:
        if self._gone is not None:
            self._gone.set()

    async def _bridge(self) -> None:
        try:
            mount: McpMount = self.app.mcp_server()
        except LookupError as exc:
            raise ApiError(503, f"no MCP server here: {exc}") from None
        if not mount.ready.is_set():  # only the first requests wait (a wait_for is a task each time)
            await asyncio.wait_for(mount.ready.wait(), 30)
        body = self.raw_body()
        self._gone = asyncio.Event()
        request = self.request
        path = request.path
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": request.protocol, "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": request.query.encode(), "client": (request.remote_ip, 0),
            "server": (request.host_name, None),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.get_all()],
        }
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self._gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if self._gone.is_set():
                return
            if message["type"] == "http.response.start":
                self.clear_header("Content-Type")
                self.set_status(message["status"])
                for name, value in message.get("headers", ()):
                    self.add_header(name.decode("latin-1"), value.decode("latin-1"))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    self.write(message["body"])
                try:
                    await self.flush()  # an SSE event reaches the client as it is sent
                except StreamClosedError:
                    self._gone.set()

        await mount.manager.handle_request(scope, receive, send)
        if not self._finished and not self._gone.is_set():
            self.finish()
