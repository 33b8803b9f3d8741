"""``GET {base}forkd/v1/sandboxes/{id}/session`` in remote mode (remote.py): the WebSocket joined to the
remote's, message by message (no buffering beyond one message).

The caller is checked as on the local route (jupyter_server's login, 401 in forkd's words). The
remote's WebSocket is opened before the caller's is accepted, so a refusal before the upgrade (404,
410, 429, 503...) reaches the caller with the remote's status and ``{"error"}``.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode

from jupyter_server.auth.decorator import ws_authenticated
from tornado import httpclient, web

from .remote import SECRET_QUERY, VIA_HEADER, error_text
from .session_handler import RelayedSession

PASSED = ("X-Forkd-Client", "User-Agent")


class RemoteSessionHandler(RelayedSession):
    @property
    def remote(self):
        return self.app.remote

    @ws_authenticated
    async def get(self, sandbox_id: str) -> None:
        remote = self.remote
        via = self.request.headers.get(VIA_HEADER, "")
        if remote.hop in (h.strip() for h in via.split(",")):
            raise web.HTTPError(508, "%s", f"c.ForkdApp.remote_url ({remote.url}) leads back to this Jupyter server")
        if not await self._authorized("execute"):
            raise web.HTTPError(403, "%s", getattr(self, "forkd_refusal", None) or "not allowed to run code in sandboxes")
        pairs = [(k, v) for k, v in parse_qsl(self.request.query, keep_blank_values=True) if k not in SECRET_QUERY]
        scheme = "wss" if remote.url.startswith("https:") else "ws"
        url = (scheme + remote.url[remote.url.index(":"):] + f"/v1/sandboxes/{sandbox_id}/session"
               + (f"?{urlencode(pairs)}" if pairs else ""))
        headers = {k: v for k, v in self.request.headers.get_all() if k in PASSED}
        headers.update(remote.headers(via))
        headers.pop("Accept-Encoding", None)
        request = httpclient.HTTPRequest(url, headers=headers, connect_timeout=remote.connect_timeout,
                                         request_timeout=remote.connect_timeout + 120)
        try:
            await self.open_upstream(request)
        except httpclient.HTTPClientError as exc:
            response = exc.response
            said = error_text(response.body or b"", response.headers.get("Content-Type", "")) if response else str(exc)
            if exc.code == 401:
                raise web.HTTPError(502, "%s", remote.refused_token(401, said).message) from None
            if exc.code == 599:  # tornado's code for no answer at all
                raise web.HTTPError(502, "%s", remote.unreachable(exc).message) from None
            raise web.HTTPError(exc.code, "%s", said) from None
        except OSError as exc:
            raise web.HTTPError(502, "%s", remote.unreachable(exc).message) from None
        await self.accept(sandbox_id)
