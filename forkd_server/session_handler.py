"""``GET /v1/sandboxes/{id}/session`` (WebSocket): a streaming session with the sandbox's agent.

Each WebSocket text message is one JSON message, both ways, exactly as the agent speaks them
(``forkd_engine/agent/session.py``); the first message from the server is the session's hello,
``{"type": "session_reply", "content": {...}}``. ``?shell=ipython`` asks for the notebook shell
(started in the sandbox if it has none). Errors before the upgrade are forkd's ``{"error"}``
bodies with 401/404/429/503 like every other route; opening one is a long call (admission.py).
"""

from __future__ import annotations

import asyncio
import json

import orjson

from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web, websocket

from .errors import ForkdError
from .handlers.base import caller_of
from .hub.identity import HubUser
from .hub.ownership import Caller
from .relay import WebSocketRelay
from .scrub import ScrubbedLog


class SessionHandler(ScrubbedLog, WebSocketMixin, websocket.WebSocketHandler, ExtensionHandlerMixin, JupyterHandler):
    auth_resource = "forkd:sandboxes"
    session = None

    @property
    def app(self):
        return self.extensionapp

    def set_default_headers(self) -> None:
        pass  # JupyterHandler's (CSP...) mean nothing to a WebSocket

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        message = getattr(exc, "log_message", None) or self._reason
        if isinstance(exc, web.HTTPError) and exc.args:
            message = message % exc.args
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": message}))

    def _unauthorized(self) -> web.HTTPError:
        sent = bool(self.request.headers.get("Authorization", "").strip() or self.get_query_argument("token", ""))
        return web.HTTPError(401, "invalid bearer token" if sent else "missing bearer token")

    async def prepare(self, *args, **kwargs) -> None:
        try:
            await super().prepare(*args, **kwargs)
        except web.HTTPError as exc:  # jupyter_server answers "no user" with 403; forkd with 401
            if exc.status_code == 403 and getattr(self, "_jupyter_current_user", None) is None:
                raise self._unauthorized() from None
            raise

    @ws_authenticated
    async def get(self, sandbox_id: str) -> None:
        if not await self._authorized("execute"):
            raise web.HTTPError(403, "%s", getattr(self, "forkd_refusal", None) or "not allowed to run code in sandboxes")
        await self._own(sandbox_id)
        shell = self.get_query_argument("shell", "plain")
        if shell not in ("plain", "ipython"):
            raise web.HTTPError(400, f"shell must be plain or ipython, got {shell!r}")
        try:
            # A long call like any other (starting IPython in a sandbox takes seconds): admitted by
            # the server's and the caller's caps, on the long pool, never the control pool.
            self.session, self.hello = await self.app.admission.long(
                lambda: self.app.sessions.open(sandbox_id, shell=shell), caller=caller_of(self),
                what="a session start", sandbox=sandbox_id)
        except ForkdError as exc:
            raise web.HTTPError(exc.status, "%s", exc.message) from None
        self.sandbox_id = sandbox_id
        await super().get(sandbox_id)

    async def _own(self, sandbox_id: str) -> None:
        """Under JupyterHub, only the sandbox's owner (or an admin) opens a session: 404 for others."""
        user = self.current_user
        if not isinstance(user, HubUser) or user.operator or user.admin:
            return
        try:
            info = await self.app.admission.control(lambda: self.app.controller.get_sandbox(sandbox_id))
        except ForkdError as exc:
            if exc.status != 404:
                raise web.HTTPError(exc.status, "%s", exc.message) from None
            info = None
        if info is None or not Caller(user.username).sees(info.get("labels")):
            raise web.HTTPError(404, "%s", f"sandbox {sandbox_id} not found")

    async def _authorized(self, action: str) -> bool:
        result = self.authorizer.is_authorized(self, self.current_user, action, self.auth_resource)
        return await result if asyncio.iscoroutine(result) else bool(result)

    def open(self, sandbox_id: str) -> None:  # type: ignore[override]
        super().open()
        self.set_nodelay(True)  # small messages both ways: no Nagle delay on a cell's round trip
        loop = asyncio.get_running_loop()
        self.write_message(json.dumps({"type": "session_reply", "content": self.hello}))

        def deliver(event: dict | None) -> None:
            loop.call_soon_threadsafe(self._deliver, event)

        self.app.sessions.pump(self.session, deliver, sandbox_id)
        self._send = self.app.sessions.writer(
            self.session, sandbox_id, lambda exc: loop.call_soon_threadsafe(self._deliver, None))

    def _deliver(self, event: dict | None) -> None:
        if self.ws_connection is None:
            return
        if event is None:
            self.close(1000, "the sandbox's agent ended the session (the sandbox was killed or exited)")
            return
        try:
            self.write_message(json.dumps(event))
        except websocket.WebSocketClosedError:
            pass

    def on_message(self, message) -> None:
        try:
            data = orjson.loads(message)  # NaN and 1,000-deep nesting are refused, not raised
            if not isinstance(data, dict):
                raise ValueError("a session message is a JSON object")
            self._send(data)
        except ValueError as exc:
            try:
                self.write_message(json.dumps({"type": "error_reply", "content": {
                    "status": "error", "ename": type(exc).__name__, "evalue": str(exc), "traceback": []}}))
            except websocket.WebSocketClosedError:
                pass

    def on_close(self) -> None:
        if self.session is not None:
            self.app.sessions.close(self.session)


class RelayedSession(WebSocketRelay, SessionHandler):
    """The session route of a Jupyter server that runs no sandbox (remote mode, router mode): the
    caller's WebSocket joined to one opened upstream (relay.py) rather than to a local session.
    ``SessionHandler``'s own ``get`` and ``open`` are skipped: it has no sandbox here to join."""

    async def accept(self, sandbox_id: str) -> None:
        """Once the upstream is open: the caller's upgrade, and the upstream let go if it failed."""
        await super(SessionHandler, self).get(sandbox_id)
        self.close_unaccepted()

    def open(self, sandbox_id: str) -> None:  # type: ignore[override]
        super(SessionHandler, self).open()
        self.set_nodelay(True)
        self.pass_early()
