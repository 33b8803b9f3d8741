"""Remote mode of the extension: ``{base_url}forkd/`` passes every call on to another forkd.

In a JupyterLab whose kernels and magics use ``FORKD_URL`` (a fleet's router, a remote ``forkd
serve``, the JupyterHub service), the panel must see that same server, not a forkd of its own
Jupyter server. With ``c.ForkdApp.remote_url`` set (by default from ``$FORKD_URL``), no controller
runs here: ``/healthz``, ``/metrics`` and every ``/v1/...`` route (the ``/v1/events`` stream as it
arrives; the session WebSocket in remote_session.py) are passed on to the remote with its token
(``c.ForkdApp.remote_token``, by default ``$FORKD_TOKEN``, else under JupyterHub
``$JUPYTERHUB_API_TOKEN``), after jupyter_server's own check of the caller. The token never reaches
the browser. ``/version`` stays this extension's own: the Lab extension checks that it matches its
own build.

The remote's change events are re-emitted on this server's event bus (``EventRelay``), which is
what keeps the panel live.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from urllib.parse import parse_qsl, quote, urlencode

import aiohttp
from jupyter_server.auth.decorator import allow_unauthenticated, authorized
from tornado import web
from tornado.iostream import StreamClosedError

from .handlers.base import ApiError, ForkdHandler
from .relay import UpstreamCall

MIB = 1 << 20
VIA_HEADER = "X-Forkd-Via"  # the remote-mode servers a request went through: a loop is refused
FORWARDED = r"(healthz/?|metrics|v1/.*)"
# What of the browser's request the remote sees: never its cookies, XSRF token or Jupyter token.
PASSED_REQUEST = frozenset({"content-type", "accept", "x-forkd-client", "last-event-id", "user-agent"})
# What of the remote's answer the browser sees: never a cookie for the Jupyter origin.
HELD_BACK = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                       "server", "date", "set-cookie", "proxy-authenticate", "upgrade", "trailer"})
SECRET_QUERY = frozenset({"token", "_xsrf"})
RETRY_MAX = 30.0  # s: the longest wait of the event relay between two attempts


class Remote:
    """The server calls are passed on to: its URL (a path, e.g. ``/services/forkd``, is kept), its
    token, and one pool of kept-alive connections, made on the server's loop at first use."""

    def __init__(self, url: str, token: str, connect_timeout: float = 5.0):
        self.url = url.rstrip("/")
        self.token = token or None
        self.connect_timeout = connect_timeout
        self.hop = secrets.token_hex(8)  # this server, in VIA_HEADER
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        return self._session

    def headers(self, via: str = "") -> dict[str, str]:
        headers = {VIA_HEADER: f"{via}, {self.hop}" if via else self.hop, "Accept-Encoding": "identity"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def timeout(self) -> aiohttp.ClientTimeout:
        # no read limit: an exec or a spawn takes as long as it takes, and the stream stays open
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)

    def unreachable(self, exc: BaseException) -> ApiError:
        return ApiError(502, f"the forkd server this Jupyter server passes calls on to, {self.url}, did not answer "
                             f"({exc or type(exc).__name__}). Check that it runs and that this host reaches it "
                             f"(curl {self.url}/healthz); it is c.ForkdApp.remote_url, by default $FORKD_URL where "
                             f"this Jupyter server started (set it to '' to run forkd here instead)",
                        {"remote": self.url})

    def refused_token(self, status: int, said: str) -> ApiError:
        where = "c.ForkdApp.remote_token, by default $FORKD_TOKEN (or $JUPYTERHUB_API_TOKEN)"
        return ApiError(502, f"the forkd server at {self.url} refused this Jupyter server's token ({status}: {said}). "
                             f"Set {where} where this Jupyter server starts to a token it accepts",
                        {"remote": self.url})

    async def leave_kernels(self, kernel_ids, log, timeout: float = 10.0) -> None:
        """Mark left the records of ``kernel_ids``, the kernels of this Jupyter server as it stops
        (``POST /v1/kernels/{id}/leave``): each notebook's next kernel says where its state still
        runs, and each kernel's own shutdown, which then finds no record, keeps its sandboxes. A
        kernel that is not forkd's has no record (404); a remote that does not answer is logged."""
        async def leave(kernel_id: str) -> None:
            try:
                async with self.session().post(f"{self.url}/v1/kernels/{quote(kernel_id, safe='')}/leave",
                                               headers=self.headers(),
                                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    if resp.status not in (204, 404):
                        log.warning("forkd: could not mark kernel %s left at %s (%s: %s)", kernel_id, self.url,
                                    resp.status, error_text(await resp.read(), resp.content_type))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.warning("forkd: could not mark kernel %s left at %s: %s", kernel_id, self.url,
                            exc or type(exc).__name__)
        await asyncio.gather(*(leave(k) for k in kernel_ids))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def forkd_error(body: bytes, content_type: str) -> dict | None:
    """A forkd error body (``{"error": "...", ...}``), or None."""
    if "json" not in content_type:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) and isinstance(parsed.get("error"), str) else None


def error_text(body: bytes, content_type: str) -> str:
    """What an error answer says: forkd's ``error``, else the start of its text."""
    parsed = forkd_error(body, content_type)
    if parsed is not None:
        return parsed["error"]
    return " ".join(body.decode("utf-8", "replace").split())[:300] or "no body"


@web.stream_request_body
class RemoteHandler(UpstreamCall, ForkdHandler):
    """One route for every call passed on: the caller is checked here as on any forkd route, the
    body kept (up to 65 MiB: a 64 MiB file write), the answer streamed back as it arrives."""

    max_body_bytes = 65 * MIB

    @property
    def remote(self) -> Remote:
        return self.extensionapp.remote

    async def prepare(self) -> None:
        via = self.request.headers.get(VIA_HEADER, "")
        if self.remote.hop in (h.strip() for h in via.split(",")):
            raise ApiError(508, f"c.ForkdApp.remote_url ({self.remote.url}) leads back to this Jupyter server: set it "
                                f"(or $FORKD_URL) to a forkd server or router, not to this server's own forkd routes")
        await self.authenticate()

    @web.authenticated
    @authorized
    async def get(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def post(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def put(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def patch(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def delete(self, path: str) -> None:
        await self.forward(path)

    async def forward(self, path: str, with_token: bool = True) -> None:
        """Pass the request on; a browser that goes away ends the remote's request too."""
        await self.call_upstream(self._forward(path, with_token))

    def target(self, path: str) -> str:
        pairs = [(k, v) for k, v in parse_qsl(self.request.query, keep_blank_values=True) if k not in SECRET_QUERY]
        return f"{self.remote.url}/{path}" + (f"?{urlencode(pairs)}" if pairs else "")

    async def _forward(self, path: str, with_token: bool) -> None:
        remote = self.remote
        headers = {k: v for k, v in self.request.headers.get_all() if k.lower() in PASSED_REQUEST}
        headers.update(remote.headers(self.request.headers.get(VIA_HEADER, "")))
        if not with_token:
            headers.pop("Authorization", None)
        body = self.raw_body() if self.request.method in ("POST", "PUT", "PATCH", "DELETE") else None
        try:
            async with remote.session().request(self.request.method, self.target(path), data=body or None,
                                                headers=headers, timeout=remote.timeout(),
                                                allow_redirects=False) as resp:
                kind = resp.headers.get("Content-Type", "")
                if resp.status >= 400:
                    await self._pass_error(resp.status, await resp.read(), kind)
                    return
                self.set_status(resp.status, resp.reason)
                for name, value in resp.headers.items():
                    if name.lower() not in HELD_BACK:
                        self.set_header(name, value)
                if resp.status in (204, 304):
                    self.finish()
                    return
                length = resp.headers.get("Content-Length", "")
                if length.isdigit() and int(length) <= MIB:  # a small answer: one write
                    self.finish(await resp.read())
                    return
                await self.flush()  # the headers now: a stream's first event may be long in coming
                async for chunk in resp.content.iter_any():  # the event stream included: no buffering
                    self.write(chunk)
                    await self.flush()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if self._headers_written:
                self.request.connection.stream.close()  # cut mid-answer: the browser sees it cut
                return
            raise remote.unreachable(exc) from None
        except StreamClosedError:
            return
        self.finish()

    async def _pass_error(self, status: int, body: bytes, kind: str) -> None:
        """An error answer as ``{"error": ...}`` with the remote's other fields; one that is not
        forkd's (a proxy's page) says who answered."""
        said = error_text(body, kind)
        if status == 401:  # the remote's token, not the caller's: the user's own login is fine
            raise self.remote.refused_token(status, said)
        parsed = forkd_error(body, kind)
        if parsed is None:
            raise ApiError(status, f"{self.remote.url} answered {status}: {said}", {"remote": self.remote.url})
        raise ApiError(status, parsed["error"], {k: v for k, v in parsed.items() if k != "error"})


class RemoteCheckoutHandler(RemoteHandler):
    """``POST v1/kernels/{id}/checkout {"sandbox"}`` (the panel's Check out) of a notebook whose
    kernel this Jupyter server runs: ``%forkd checkout`` in that kernel, here (kernel_handlers.py),
    which moves its HEAD on the remote; the remote's own server runs no such kernel and would answer
    409. Then the kernel's record as the remote has it. A kernel of another server is passed on."""

    auth_resource = "forkd:kernels"

    @web.authenticated
    @authorized(action="execute")
    async def post(self, path: str, kernel_id: str) -> None:
        from .kernel_handlers import CHECKOUT, SAFE_ID, checkout_in_kernel

        manager = self.serverapp.kernel_manager
        if kernel_id not in manager.list_kernel_ids():
            await self.forward(path)
            return
        target = self.body(CHECKOUT)["sandbox"]
        if not SAFE_ID.match(target):
            raise ApiError(400, f"{target!r} is not a sandbox id\nlist_sandboxes (GET /v1/sandboxes) names them")
        record = await self.remote_json(f"v1/kernels/{quote(kernel_id, safe='')}")
        await self.remote_json(f"v1/sandboxes/{quote(target, safe='')}")  # 404 saying how it ended, before the kernel
        notebook = record.get("notebook") if isinstance(record, dict) else None
        await checkout_in_kernel(manager, kernel_id, target, notebook)
        self.send(await self.remote_json(f"v1/kernels/{quote(kernel_id, safe='')}"))

    async def remote_json(self, path: str):
        """``GET path`` of the remote, parsed; its error answer raised as this route's."""
        remote = self.remote
        try:
            async with remote.session().get(f"{remote.url}/{path}", headers=remote.headers(
                    self.request.headers.get(VIA_HEADER, "")), timeout=remote.timeout()) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    await self._pass_error(resp.status, body, resp.headers.get("Content-Type", ""))
                return json.loads(body)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise remote.unreachable(exc) from None


class RemoteHealthHandler(RemoteHandler):
    """``/healthz`` passed on: public, as everywhere; the remote's token (and so its capacity
    block) only for a caller this server knows."""

    public = True

    @allow_unauthenticated
    async def get(self, path: str) -> None:
        await self.forward(path, with_token=self.current_user is not None)


def routes(prefix: str) -> list[tuple[str, type]]:
    """The forwarding routes, relative to base_url (``prefix``: the extension's route prefix)."""
    # the session is a WebSocket joined to the remote's (imported here: remote_session imports this module)
    from .remote_session import RemoteSessionHandler

    return [(f"/{prefix}(healthz/?)", RemoteHealthHandler),
            (f"/{prefix}v1/sandboxes/([^/]+)/session", RemoteSessionHandler),
            (f"/{prefix}(v1/kernels/([^/]+)/checkout)", RemoteCheckoutHandler),
            (f"/{prefix}{FORWARDED}", RemoteHandler)]


class EventRelay:
    """Reads the remote's ``/v1/events`` for as long as the server runs and hands each change to
    ``publish`` (the extension's event hub, which puts it on jupyter_server's event bus). A stream
    that ends or cannot open is opened again after 1 s, then twice as long each time up to 30 s
    (afresh once a stream was read for longer than that); each outage is said once in the log; changes
    made meanwhile are not replayed, and the panel's periodic re-read catches up with them."""

    def __init__(self, remote: Remote, publish, log):
        self.remote, self.publish, self.log = remote, publish, log
        self.task: asyncio.Task | None = None
        self.was_open = False  # the last read of the stream got as far as its first line

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
            self.task = None

    async def _run(self) -> None:
        wait, failing = 1.0, False
        loop = asyncio.get_running_loop()
        while True:
            opened, self.was_open = loop.time(), False
            try:
                why = await self._stream()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                why = f"did not answer ({exc or type(exc).__name__})"
            except Exception as exc:  # noqa: BLE001 - garbage on the stream must not end the relay for good
                why = f"sent what is not an event stream ({type(exc).__name__}: {exc})"
            if self.was_open:  # an outage begins now: said, once
                failing = False
            if loop.time() - opened > RETRY_MAX:  # it was read a good while: start the waits afresh
                wait = 1.0
            if not failing:
                self.log.warning("forkd: the change events of %s %s; the panel is not kept live until they are "
                                 "read again (retrying, at most every %g s)", self.remote.url, why, RETRY_MAX)
            failing = True
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_MAX)

    async def _stream(self) -> str:
        """One read of the stream until it ends; says why it did."""
        headers = {**self.remote.headers(), "Accept": "text/event-stream"}
        async with self.remote.session().get(f"{self.remote.url}/v1/events", headers=headers,
                                             timeout=self.remote.timeout()) as resp:
            if resp.status != 200:
                body = await resp.read()
                return f"could not be read ({resp.status}: {error_text(body, resp.headers.get('Content-Type', ''))})"
            self.was_open = True
            self.log.info("forkd: relaying the change events of %s", self.remote.url)
            data: list[str] = []
            async for raw in resp.content:  # one line at a time; an event ends with a blank line
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].lstrip())
                elif not line and data:
                    self._emit("\n".join(data))
                    data = []
        return "ended"

    def _emit(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError:
            self.log.warning("forkd: %s sent an event that is not JSON: %.200s", self.remote.url, text)
            return
        if isinstance(event, dict):
            self.publish(event)
