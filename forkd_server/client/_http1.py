"""The async SDK's kept-alive connections: HTTP/1.1 (h11's state machine, the wire format as
httpcore speaks it) on asyncio's own transports, the way the sync SDK pools ``http.client``
connections.

Why not aiohttp's pool for these calls: it took ~0.2 ms of CPU a call here (a request object, its
headers, a timer, a writer task...), as much as a third of what the server spends answering a
ping, on the same two cores. This does what the SDK's exchanges need and no more: one request at a
time per connection, every framing h11 reads (Content-Length, chunked with trailers, up to the
close, interim answers); idle connections in a stack (the most recently used taken first), one the
server closed meanwhile dropped before it is used. Event streams and WebSocket sessions still go
through aiohttp (``_async``, ``streaming``).
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import h11

from ._core import CONNECT_TIMEOUT, MISSING_HEADER

MISSING = MISSING_HEADER.lower().encode()  # h11 gives header names in lower case

MAX_HEAD = 64 * 1024  # bytes of status line and headers an answer may have
REQUESTS_KEPT = 64  # h11 requests kept for reuse (an event is immutable: it can be sent again)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # sent with Content-Length: 0 when empty, as http.client


class Dropped(ConnectionError):
    """The connection closed before a whole answer came (the server closed a kept connection)."""


class Timeout(TimeoutError):
    """No answer, or no more of it, within the request's timeout."""


class _Connection(asyncio.Protocol):
    """One connection: h11's view of it (fed as bytes arrive), and a future that the next arrival
    (or the end) completes."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self.lost = loop.create_future()  # done once the socket is closed

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.h11.receive_data(data)
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self.h11.receive_data(b"")
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc) -> None:
        if not self.closed:
            self.closed = True
            self.h11.receive_data(b"")
        self._wake()
        if not self.lost.done():
            self.lost.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self, timeout: float) -> None:
        """Wait for more bytes; ``Dropped`` once the connection closed, ``Timeout`` after ``timeout``."""
        if self.closed:
            raise Dropped("the server closed the connection before its answer")
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
        """Both sides are done with the last exchange and neither said it closes: ready for another."""
        if self.closed or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
            return False
        self.h11.start_next_cycle()
        return True

    async def exchange(self, request: h11.Request, content: bytes | None,
                       timeout: float) -> tuple[int, bytes, str | None]:
        """Send one request and read its answer: (status, body, a router's missing-hosts header)."""
        wire = self.h11.send(request)
        if content:
            wire += self.h11.send(h11.Data(data=content))
        self.transport.write(wire + self.h11.send(h11.EndOfMessage()))
        status, body, missing = 0, [], None
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise Dropped(f"not an HTTP answer forkd can read: {exc}") from None
            if event is h11.NEED_DATA:
                await self.more(timeout)
            elif isinstance(event, h11.Response):
                status = event.status_code
                missing = next((v.decode("latin-1") for k, v in event.headers if k == MISSING), None)
            elif isinstance(event, h11.Data):
                body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return status, b"".join(body), missing
            elif isinstance(event, h11.ConnectionClosed):
                raise Dropped("the server closed the connection before its answer")
            # an InformationalResponse (100 Continue): the real answer follows


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
        # h11's form of the requests sent lately: it checks every header of a new one (a fifth of the
        # client's CPU a ping), and the same request comes again and again (polls, gathered pings)
        self._requests: dict[tuple, h11.Request] = {}
        self._slots = asyncio.Semaphore(size)
        self._size = size
        self.closed = False

    async def request(self, method: str, target: str, headers: dict, content: bytes | None,
                      timeout: float) -> tuple[int, bytes, str | None]:
        """(status, body, a router's missing-hosts header) of one exchange. An exception from
        ``_connect`` means nothing was sent."""
        fields = [("Host", self._host_header), *((k, str(v)) for k, v in headers.items())]
        if content or method in _BODY_METHODS:
            fields.append(("Content-Length", str(len(content or b""))))
        key = (method, target, *fields)
        request = self._requests.get(key)
        if request is None:
            try:
                request = h11.Request(method=method, target=target, headers=fields)
            except h11.LocalProtocolError as exc:  # what would break the request apart, as http.client refuses it
                what = "a request target" if "target" in str(exc) else "a header name or value"
                raise ValueError(f"{what} may not contain control characters or spaces: {exc}") from None
            if len(self._requests) >= REQUESTS_KEPT:
                del self._requests[next(iter(self._requests))]  # the oldest
            self._requests[key] = request
        async with self._slots:
            conn = await self._take(timeout)
            try:
                answer = await conn.exchange(request, content, timeout)
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
