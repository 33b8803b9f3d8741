"""``forkd serve``'s plain pings, answered without a tornado ``RequestHandler``.

A ping is the call clients make most (an SDK waiting for a sandbox, the panel's busy re-read, an
agent's health check), and its own work is small: the sandbox's row and one line to its agent
(loop_calls.py). The ``RequestHandler`` around it (its default headers and ``Date``, jupyter_server's
prepare and finish, the coroutine that runs it) was over a third of the server's CPU per ping
(bench/RESULTS.md). So in ``forkd serve``, where the token is the only way in, a ping that is
plainly fine is answered here: ``POST {base_url}v1/sandboxes/{id}/ping`` with the server's token in
``Authorization``, no query, no body, no ``Origin``, a ``Host`` the full handler has let in before,
a running sandbox whose agent answers on the event loop. The answer is the full handler's: its
body, and the headers ``PingHandler`` sent with its own first 200 to such a request (``learn``);
until one has been answered that way, every ping takes the full route. Anything else, a failure
included, is replayed through ``PingHandler``, which answers as before; a ping whose agent failed
here is not made again there: the handler is given the failure to explain (410 if the sandbox
ended during it, else 500 saying what failed), as it explains its own.
"""

from __future__ import annotations

import asyncio
import time

from jupyter_server.utils import url_path_join
from prometheus_client import Counter
from tornado import httputil, routing
from tornado.log import app_log

from .handlers.base import ForkdHandler, dumps
from .identity import same_secret
from .loop_calls import FailedOnLoop

PATH = "v1/sandboxes/([^/]+)/ping"
_NOT_LEARNED = ("Date", "Content-Length")  # per answer


class PlainPings(routing.Router):
    """The rule ahead of the route table for a ping's path: a ``PlainPing`` for a plain one, else
    None (the route table's ``PingHandler`` takes it)."""

    def __init__(self, forkd_app, serverapp):
        self.forkd = forkd_app
        self.web_app = serverapp.web_app
        self.identity = serverapp.identity_provider
        self.headers: list[tuple[str, str]] | None = None  # learned from PingHandler's 200
        self.answered = Counter("forkd_plain_pings", "Pings answered without a RequestHandler (forkd serve's "
                                "plain pings; the others are PingHandler's)", registry=forkd_app.metrics.registry)
        self._date: tuple[int, str] = (0, "")

    def install(self) -> None:
        base = self.web_app.settings.get("base_url", "/")
        rule = routing.Rule(routing.PathMatches(url_path_join(base, self.forkd.route_prefix, PATH)), self)
        self.web_app.default_router.rules.insert(0, rule)  # before every host's routes

    def plain(self, request: httputil.HTTPServerRequest) -> bool:
        """The ping ``PingHandler`` would answer with nothing more than its agent's reply."""
        headers = request.headers
        scheme, _, sent = headers.get("Authorization", "").partition(" ")
        return (request.method == "POST" and not request.query and "Origin" not in headers
                and headers.get("Content-Length", "0") == "0" and "Transfer-Encoding" not in headers
                and scheme.lower() in ("bearer", "token") and same_secret(sent, self.identity.token)
                and ForkdHandler.host_let_in(request.host, self.web_app.settings))

    def learn(self, request: httputil.HTTPServerRequest, headers: httputil.HTTPHeaders) -> None:
        """``PingHandler``'s 200 to ``request``: its headers are a plain ping's from now on (unless
        it set a cookie, which is no plain ping's: then every ping stays the handler's)."""
        if self.headers is None and self.plain(request) and "Set-Cookie" not in headers:
            self.headers = [(name, value) for name, value in headers.get_all() if name not in _NOT_LEARNED]

    def find_handler(self, request, path_args=(), **_) -> httputil.HTTPMessageDelegate | None:
        if self.headers is None or not self.plain(request):
            return None
        return PlainPing(self, request, path_args[0])

    def date(self) -> str:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, httputil.format_timestamp(now))
        return self._date[1]


class PlainPing(httputil.HTTPMessageDelegate):
    """One plain ping: answered from the agent's reply, or replayed through ``PingHandler``. It
    stands for the handler in the access log and the request metric (``log_request``)."""

    def __init__(self, pings: PlainPings, request: httputil.HTTPServerRequest, raw_id: bytes):
        self.pings = pings
        self.request = request
        self._raw_id = raw_id
        self._start = None
        self._chunks: list[bytes] = []
        self._full = None  # PingHandler's delegate, once replayed
        self._task = None  # held here: the loop keeps only a weak reference to a task
        self.current_user = pings.identity.holder  # who the token is (ForkdIdentityProvider)
        self.log = pings.forkd.serverapp.log  # a jupyter handler's log

    def headers_received(self, start_line, headers) -> None:
        self._start = (start_line, headers)

    def data_received(self, chunk: bytes) -> None:
        self._chunks.append(chunk)  # a body after all: replayed, PingHandler answers it

    def finish(self) -> None:
        self._task = asyncio.ensure_future(self._answer())

    def on_connection_close(self) -> None:
        if self._full is not None:
            self._full.on_connection_close()

    def get_status(self) -> int:
        return 200  # the only answer given here

    async def _answer(self) -> None:
        try:
            reply = await self._reply()
        except FailedOnLoop as failed:
            self.request.ping_failed_on_loop = failed  # PingHandler explains it, without a second try
            reply = None
        except Exception:  # noqa: BLE001 - never a request left without an answer: the handler's
            app_log.exception("forkd: a plain ping failed; PingHandler answers it")
            reply = None
        if reply is None:
            self._replay()
            return
        body = dumps(reply)
        headers = httputil.HTTPHeaders()  # a new one each time: tornado adds to it for an HTTP/1.0 keep-alive
        for name, value in self.pings.headers:
            headers.add(name, value)
        headers["Date"] = self.pings.date()
        headers["Content-Length"] = str(len(body))
        connection = self.request.connection
        connection.write_headers(httputil.ResponseStartLine("", 200, "OK"), headers, body)
        connection.finish()  # a client gone meanwhile: both are no-ops on the closed stream
        self.request._finish_time = time.time()
        self.pings.answered.inc()
        self.pings.web_app.log_request(self)

    async def _reply(self) -> dict | None:
        """The agent's reply, or None where the ping is the handler's after all."""
        try:
            sandbox_id = self._raw_id.decode()
        except UnicodeDecodeError:
            return None
        if self._chunks:
            return None
        forkd = self.pings.forkd
        return await forkd.loop_calls.ping_now(forkd.controller, sandbox_id)

    def _replay(self) -> None:
        from .handlers.sandboxes import PingHandler

        self._full = full = self.pings.web_app.get_handler_delegate(
            self.request, PingHandler, {"name": self.pings.forkd.name}, [self._raw_id])
        full.headers_received(*self._start)
        for chunk in self._chunks:
            full.data_received(chunk)
        full.finish()

