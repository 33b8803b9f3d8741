"""The base of every route of the router: its token check, ``{"error"}`` answers, and passing a
request on to a host (parsed, or as it streams)."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import parse_qsl, urlencode

import aiohttp
import orjson
from tornado import web
from tornado.iostream import StreamClosedError

from ...errors import internal_error
from ...hub.ownership import Caller
from ...identity import same_secret
from ...relay import UpstreamCall
from ...scrub import ScrubbedLog
from ..hosts import HOP_BY_HOP, Host, HostError
from ..router import Refusal, Router

MISSING_HEADER = "X-Forkd-Hosts-Missing"  # hosts whose part of a merged answer is missing, and why


SECRET_QUERY = frozenset({"token", "_xsrf"})  # the caller's credentials to the router (or Jupyter), not a host's


def host_query(handler: web.RequestHandler) -> str:
    """The request's query without ``token`` or ``_xsrf`` (the router's secrets, not the host's)."""
    pairs = [(k, v) for k, v in parse_qsl(handler.request.query, keep_blank_values=True) if k not in SECRET_QUERY]
    return ("?" + urlencode(pairs)) if pairs else ""


def sent_token(handler: web.RequestHandler) -> str | None:
    header = handler.request.headers.get("Authorization", "").strip()
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() in ("bearer", "token"):
            return value.strip()
    return handler.get_query_argument("token", None)


def check_token(handler: web.RequestHandler, expected: str | None) -> None:
    if expected is None:
        return
    token = sent_token(handler)
    if not same_secret(token, expected):
        raise Refusal(401, "invalid bearer token" if token else "missing bearer token")


class RouterHandler(ScrubbedLog, UpstreamCall, web.RequestHandler):
    public = False
    # Under JupyterHub (fleet/hub.py): what a user (not an admin) may do here. ``for_users``: the
    # route keeps each user to their own objects (else admins only); ``admin_only``: why not, said in
    # the 403; ``owned``: the kind the first path argument names, which the caller must see (404),
    # and ``changes`` the methods that change it (403 for a shared snapshot); ``stamps``: the methods
    # whose body gets the caller's owner label; ``checks_labels``: those whose labels are checked;
    # ``body_owns``: (method, kind, field): what a body names, which the caller must see (404);
    # ``creates``: methods that may make the ``owned`` object when no host has it (a kernel record).
    auth_resource = "forkd:server"
    for_users = False
    admin_only: str | None = None
    owned: str | None = None
    changes: tuple[str, ...] = ()
    stamps: tuple[str, ...] = ()
    checks_labels: tuple[str, ...] = ()
    body_owns: tuple[tuple[str, str, str], ...] = ()
    creates: tuple[str, ...] = ()
    caller: Caller | None = None  # the Hub user the request acts for (None: the router's own token)

    @property
    def router(self) -> Router:
        return self.settings["forkd_router"]

    @property
    def hub(self):
        """The router's JupyterHub mode (fleet/hub.py), or None."""
        return self.settings.get("forkd_hub")

    @property
    def api_path(self) -> str:
        """The request's path as a host has it (``/v1/...``): the router's own routes sit at the
        root; mounted in a Jupyter server (extension.py) they sit under its prefix."""
        return self.request.path

    async def prepare(self) -> None:
        if not self.public:
            self.caller = await self.admit()

    async def admit(self) -> Caller | None:
        """Who calls: None for one who sees everything, else the Hub user (hub.py); a Refusal if no
        one may. The router's token, or JupyterHub's word under ``--hub``; a Jupyter server that
        mounts the router asks its own login instead (extension.py)."""
        if self.hub is None:
            check_token(self, self.settings["forkd_token"])
            return None
        return await self.hub.admit(self)

    @property
    def sse_keepalive(self) -> float:
        """Seconds between keep-alive comments on an event stream (a Jupyter server's is its own)."""
        return self.settings.get("sse_keepalive", 15.0)

    @property
    def viewer(self) -> Caller | None:
        """The caller whose views are kept to their own objects (None: one who sees everything)."""
        return self.caller if self.caller is not None and not self.caller.admin else None

    def seen(self, kind: str, items: list) -> list:
        """What of ``items`` (``sandbox``, ``snapshot``, ``workspace`` records or tree ``node``s) the
        caller sees (all without JupyterHub)."""
        return items if self.hub is None else self.hub.visible(self.caller, kind, items)

    def check_xsrf_cookie(self) -> None:
        pass  # bearer tokens only: no cookie carries authority here

    def compute_etag(self):
        return None

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        fields = {}
        if isinstance(exc, Refusal):
            message, fields = exc.message, exc.fields
        elif isinstance(exc, web.HTTPError):
            message = (exc.log_message % exc.args) if exc.log_message else (exc.reason or self._reason)
        else:
            message = internal_error(exc)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": message, **fields}))

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, Refusal):
            if not self._finished:
                self.set_status(e.status)
                self.write_error(e.status, exc_info=(type(e), e, None))
            return
        super()._handle_request_exception(e)

    def send(self, body, status: int = 200, missing: list[str] | None = None) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        if missing:
            self.set_header(MISSING_HEADER, "; ".join(m.replace("\n", " ")[:300] for m in missing))
        self.finish(json.dumps(body))

    def answer(self, status: int, body) -> None:
        """Pass a host's answer on (a parsed one)."""
        if status == 204 or body is None:
            self.set_status(status)
            self.finish()
        else:
            self.send(body, status)

    def answer_made_snapshot(self, host: Host, status: int, reply, made: tuple[int, ...]) -> None:
        """Pass on a host's answer to a call that makes a snapshot (create, branch, compact): one it
        made (``status`` in ``made``) is pinned to ``host``, named with it, and its labels kept."""
        if status in made and isinstance(reply, dict) and isinstance(reply.get("tag"), str):
            self.router.state.pin("snapshot", [(reply["tag"], None)], host.url, exclusive=False)
            reply["host"] = host.url
            self.seen("snapshot", [reply])
        self.answer(status, reply)

    def json_body(self) -> dict | None:
        """The body as a JSON object, or None when it is not one (a host then says what is wrong).
        Parsed as a host parses it (orjson): what the router reads (a spawn's snapshot, the labels
        it sets under JupyterHub) is what the host acts on, and nesting past its limit is no error."""
        ctype = self.request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
            return None
        try:
            data = orjson.loads((self.request.body or b"").strip() or b"null")
        except orjson.JSONDecodeError:
            return None
        return data if isinstance(data, dict) else None

    def client_headers(self) -> dict:
        """The request's headers a host should see: all but hop-by-hop ones and the credentials."""
        return {k: v for k, v in self.request.headers.get_all() if k.lower() not in HOP_BY_HOP}

    async def call(self, host: Host, path: str | None = None, body: bytes | None = None) -> tuple[int, object]:
        """This request passed on to ``host`` and its answer parsed (for small JSON answers the
        router adds to); HostError becomes 502."""
        try:
            return await host.request_json(self.request.method, path or (self.api_path + host_query(self)),
                                           body if body is not None else (self.request.body or None),
                                           timeout=None, session="calls", headers=self.client_headers())
        except HostError as exc:
            raise Refusal(502, f"{exc}\nthe router marks a host down after {self.router.settings.down_after:g} s "
                               f"without a good heartbeat", host=host.url) from None

    # --- passing a request on as it streams --------------------------------------------------------

    async def forward(self, host: Host, path: str | None = None) -> None:
        """Pass this request to ``host`` and its answer back as it arrives (no buffering); a
        client that goes away ends the host's request too."""
        await self.call_upstream(self._forward(host, path or self.api_path))

    async def _forward(self, host: Host, path: str) -> None:
        s = self.router.settings
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout)
        try:
            async with host.calls.request(self.request.method, host.url + path + host_query(self),
                                          data=self.request.body or None, headers=self.client_headers(),
                                          timeout=timeout, allow_redirects=False) as resp:
                self.set_status(resp.status, resp.reason)
                for name, value in resp.headers.items():
                    if name.lower() not in HOP_BY_HOP and name.lower() not in ("server", "date"):
                        self.set_header(name, value)
                if resp.status in (204, 304):  # no body, whatever a host sends
                    self.finish()
                    return
                length = resp.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) <= 1 << 20:  # small: one write
                    self.finish(await resp.read())
                    return
                async for chunk in resp.content.iter_any():
                    self.write(chunk)
                    await self.flush()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if self._headers_written:
                self.request.connection.stream.close()  # cut mid-answer: the client sees it cut
                return
            self.clear_header("Content-Type")
            raise Refusal(502, f"host {host.url} did not answer: {exc or type(exc).__name__}\nthe router marks a "
                               f"host down after {s.down_after:g} s without a good heartbeat", host=host.url) from None
        except StreamClosedError:
            return
        self.finish()
