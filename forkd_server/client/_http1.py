"""The async SDK's kept-alive connections: HTTP/1.1 on asyncio's own transports, answers read by
llhttp (Node.js's parser, through httptools), the way the sync SDK pools ``http.client``
connections.

Why not aiohttp's pool for these calls: it took ~0.2 ms of CPU a call here (a request object, its
headers, a timer, a writer task...), as much as a third of what the server spends answering a
ping, on the same two cores. Why not h11 (used before): its pure-Python state machine was over a
third of the client's CPU per gathered ping. This does what the SDK's exchanges need and no more:
one request at a time per connection, every framing an answer may have (Content-Length, chunked
with trailers, up to the close, interim answers); idle connections in a stack (the most recently
used taken first), one the server closed meanwhile dropped before it is used. Event streams and
WebSocket sessions still go through aiohttp (``_async``, ``streaming``).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from urllib.parse import urlsplit

import httptools

from ._core import CONNECT_TIMEOUT, MISSING_HEADER

MISSING = MISSING_HEADER.lower().encode()

MAX_HEAD = 64 * 1024  # bytes of status line and headers an answer may have
HEADS_KEPT = 64  # request heads kept encoded (polls and gathered pings send the same one again and again)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # sent with Content-Length: 0 when empty, as http.client
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")  # a method or header name (RFC 9110)
_TARGET = re.compile(r"[\x21-\x7e]+\Z")  # no space, no control character
_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*\Z")  # a header value: tabs, no other control character


class Dropped(ConnectionError):
    """The connection closed before a whole answer came (the server closed a kept connection)."""


class Timeout(TimeoutError):
    """No answer, or no more of it, within the request's timeout."""


def request_head(method: str, target: str, fields: list[tuple[str, str]]) -> bytes:
    """The request line and headers, checked as http.client checks them: no control character or
    space may split them into other requests or headers (``ValueError``)."""
    if not _TOKEN.match(method):
        raise ValueError(f"a request method must be a token: {method!r}")
    if not _TARGET.match(target):
        raise ValueError(f"a request target may not contain control characters or spaces: {target!r}")
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in fields:
        if not _TOKEN.match(name) or not _VALUE.match(value):
            raise ValueError(f"a header name or value may not contain control characters or spaces: {name!r}")
        lines.append(f"{name}: {value.strip()}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Connection(asyncio.Protocol):
    """One connection: its parser (fed as bytes arrive), the answer being read, and a future that
    the next arrival (or the end) completes."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self.lost = loop.create_future()  # done once the socket is closed
        self._reading = False  # an answer is awaited
        self._broken: str | None = None  # why the bytes are no answer forkd can read
        self._new_answer()

    def _new_answer(self) -> None:
        self.status = 0
        self._head = 0  # bytes of headers so far
        self._missing: str | None = None
        self._framed = False  # Content-Length or chunked: the answer does not end with the connection
        self._body: list[bytes] = []
        self._headers_done = self._done = self._keep_alive = False

    # --- httptools' callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._done:  # a second answer to one request
            self._broken = "the server sent bytes that answer no request"

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head += len(name) + len(value) + 4
        if self._head > MAX_HEAD:
            raise httptools.HttpParserError(f"an answer's headers are larger than {MAX_HEAD} bytes")
        lower = name.lower()
        if lower in (b"content-length", b"transfer-encoding"):
            self._framed = True
        elif lower == MISSING:
            self._missing = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200:  # an interim answer (100 Continue): the real one follows
            self._new_answer()
        else:
            self._done = True
            self._keep_alive = self._parser.should_keep_alive()  # the parser forgets it once the answer ends

    # --- the transport's --------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self._reading or self._done:  # bytes nobody asked for: this connection is no use
            self._broken = "the server sent bytes that answer no request"
            self.close()
        else:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._broken = "the server switched protocols"
            except httptools.HttpParserError as exc:
                self._broken = str(exc) or type(exc).__name__
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._wake()
        if not self.lost.done():
            self.lost.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self, timeout: float) -> None:
        """Wait for more bytes (or the end); ``Timeout`` after ``timeout``."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    @property
    def reusable(self) -> bool:
        """The last answer was whole and neither side said it closes: ready for another."""
        return not self.closed and self._broken is None and self._done and self._keep_alive

    async def exchange(self, head: bytes, content: bytes | None, timeout: float) -> tuple[int, bytes, str | None]:
        """Send one request and read its answer: (status, body, a router's missing-hosts header)."""
        self._new_answer()
        self._reading = True
        self.transport.write(head + content if content else head)
        try:
            while not self._done:
                if self._broken is not None:
                    raise Dropped(f"not an HTTP answer forkd can read: {self._broken}")
                if self.closed:
                    if self._headers_done and not self._framed:  # an answer that ends with the connection
                        break
                    raise Dropped("the server closed the connection before its answer")
                await self.more(timeout)
        finally:
            self._reading = False
        return self.status, b"".join(self._body), self._missing


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(Timeout("no answer in time"))


class Pool:
    """At most ``size`` connections to ``base_url``'s server, kept open between calls, on the event
    loop that made the pool. ``request`` raises ``NotConnected`` when no connection could be made
    (nothing was sent), ``Dropped`` when the connection closed before a whole answer, ``Timeout``
    when none came in time."""

    def __init__(self, base_url: str, size: int):
        split = urlsplit(base_url)
        self._https = split.scheme == "https"
        self._host = split.hostname or "127.0.0.1"
        self._port = split.port or (443 if self._https else 80)
        default_port = 443 if self._https else 80
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = host if self._port == default_port else f"{host}:{self._port}"
        self._ssl = ssl.create_default_context() if self._https else None
        self._idle: list[_Connection] = []
        self._heads: dict[tuple, bytes] = {}  # request heads sent lately, encoded and checked once
        self._slots = asyncio.Semaphore(size)
        self._size = size
        self.closed = False

    async def request(self, method: str, target: str, headers: dict, content: bytes | None,
                      timeout: float) -> tuple[int, bytes, str | None]:
        """(status, body, a router's missing-hosts header) of one exchange. An exception from
        ``_connect`` means nothing was sent."""
        if method == "HEAD":  # an answer's length says what a GET's would be: the parser cannot tell
            raise ValueError("the async SDK's pool sends no HEAD requests")
        fields = [("Host", self._host_header), *((k, str(v)) for k, v in headers.items())]
        if content or method in _BODY_METHODS:
            fields.append(("Content-Length", str(len(content or b""))))
        key = (method, target, *fields)
        head = self._heads.get(key)
        if head is None:
            head = request_head(method, target, fields)
            if len(self._heads) >= HEADS_KEPT:
                del self._heads[next(iter(self._heads))]  # the oldest
            self._heads[key] = head
        async with self._slots:
            conn = await self._take(timeout)
            try:
                answer = await conn.exchange(head, content, timeout)
            except BaseException:  # a cancelled or failed exchange may still be answered: never reused
                conn.close()
                raise
            if not self.closed and conn.reusable:
                self._idle.append(conn)
            else:
                conn.close()
            return answer

    async def _take(self, timeout: float) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            conn.close()
        return await self._connect(timeout)

    async def _connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(loop), self._host, self._port, ssl=self._ssl,
                server_hostname=self._host if self._ssl else None), min(timeout, CONNECT_TIMEOUT))
        except asyncio.TimeoutError:
            raise NotConnected(f"no connection to {self._host}:{self._port} within {min(timeout, CONNECT_TIMEOUT):g} s"
                               + (" (the TLS handshake had no answer)" if self._ssl else "")) from None
        except OSError as exc:
            raise NotConnected(str(exc)) from exc
        return conn

    async def aclose(self) -> None:
        """Close the idle connections (their sockets closed on return), and each busy one as its
        exchange ends."""
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        if idle:
            await asyncio.wait([conn.lost for conn in idle], timeout=5)


class NotConnected(ConnectionError):
    """No connection could be made: nothing was sent."""
