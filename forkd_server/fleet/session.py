"""``GET /v1/sandboxes/{id}/session`` through the router: a WebSocket to the sandbox's host, joined
to the client's message by message (no buffering beyond one message).

The host's WebSocket is opened before the client's is accepted, so a refusal before the upgrade
(401, 404, 410, 429, 503) reaches the client as the host said it, status and ``{"error"}`` body.
"""

from __future__ import annotations

import json

from tornado import httpclient, web, websocket

from ..relay import WebSocketRelay
from ..scrub import ScrubbedLog
from .handlers import check_token, host_query
from .router import Refusal, Router

PASSED_HEADERS = ("X-Forkd-Client", "User-Agent")


class HostSession:
    """Joining a caller's WebSocket to the sandbox host's session, whoever checked the caller: the
    router's own route (``SessionProxy``) and the one a Jupyter server mounts (extension.py). For
    a ``WebSocketRelay``; ``router`` and ``api_path`` come from the handler."""

    def _refuse(self, status: int, body) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(body if isinstance(body, bytes) else json.dumps(body))

    async def join_host(self, sandbox_id: str) -> bool:
        """Open the host's WebSocket for ``sandbox_id``: True, or False once the caller was
        answered the refusal (the router's, or the host's own status and body)."""
        try:
            host = await self.router.locate("sandbox", sandbox_id)
        except Refusal as exc:
            self._refuse(exc.status, {"error": exc.message, **exc.fields})
            return False
        scheme = "wss" if host.url.startswith("https:") else "ws"
        url = scheme + host.url[host.url.index(":"):] + self.api_path + host_query(self)
        headers = {k: v for k, v in self.request.headers.get_all() if k in PASSED_HEADERS}
        if host.token:
            headers["Authorization"] = f"Bearer {host.token}"
        request = httpclient.HTTPRequest(url, headers=headers, connect_timeout=self.router.settings.connect_timeout,
                                         request_timeout=self.router.settings.connect_timeout + 120,
                                         ssl_options=host.tls)
        try:
            await self.open_upstream(request)
        except httpclient.HTTPClientError as exc:
            body = exc.response.body if exc.response is not None and exc.response.body else \
                {"error": f"host {host.url} refused the session: {exc}"}
            self._refuse(exc.code, body)
            return False
        except OSError as exc:
            self._refuse(502, {"error": f"host {host.url} did not answer: {exc}", "host": host.url})
            return False
        return True


class SessionProxy(HostSession, ScrubbedLog, WebSocketRelay, websocket.WebSocketHandler):
    # under JupyterHub (hub.py): any user's, about a sandbox they see
    auth_resource, for_users, admin_only, owned, changes, stamps, checks_labels, body_owns, creates = \
        "forkd:server", True, None, "sandbox", (), (), (), (), ()
    @property
    def router(self) -> Router:
        return self.settings["forkd_router"]

    @property
    def api_path(self) -> str:
        return self.request.path

    def check_origin(self, origin: str) -> bool:
        return True  # the token, never a cookie, carries authority: another origin gains nothing

    async def get(self, sandbox_id: str) -> None:
        try:
            hub = self.settings.get("forkd_hub")
            if hub is None:
                check_token(self, self.settings["forkd_token"])
            else:
                await hub.admit(self)
        except Refusal as exc:
            self._refuse(exc.status, {"error": exc.message, **exc.fields})
            return
        except web.HTTPError as exc:  # the Hub did not answer whose the token is (503)
            self._refuse(exc.status_code, {"error": (exc.log_message % exc.args) if exc.log_message else exc.reason})
            return
        if not await self.join_host(sandbox_id):
            return
        await super().get(sandbox_id)
        self.close_unaccepted()

    def open(self, *args) -> None:
        self.pass_early()
