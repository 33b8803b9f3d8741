"""The async SDK's kept-alive connections: HTTP/1.1 on asyncio's own transports, the way the sync
SDK pools ``http.client`` connections.

Why not aiohttp's pool for these calls: it took ~0.2 ms of CPU a call here (a request object, its
headers, a timer, a writer task...), as much as a third of what the server spends answering a
ping, on the same two cores. This does what the SDK's exchanges need and no more: one request at a
time per connection, bodies by ``Content-Length`` or chunked, or up to the close; idle connections
in a stack (the most recently used taken first), one the server closed meanwhile dropped before it
is used. Event streams and WebSocket sessions still go through aiohttp (``_async``, ``streaming``).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024  # bytes of status line and headers an answer may have
_NO_BODY_STATUS = frozenset({204, 304})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # sent with Content-Length: 0 when empty, as http.client


class Dropped(ConnectionError):
    """The connection closed before a whole answer came (the server closed a kept connection)."""


class Timeout(TimeoutError):
    """No answer, or no more of it, within the request's timeout."""


class _Connection(asyncio.Protocol):
    """One connection: what arrived, and a future that the next arrival (or the end) completes."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self.lost = loop.create_future()  # done once the socket is closed

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
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

    async def exchange(self, head: bytes, content: bytes | None, method: str,
                       timeout: float) -> tuple[int, bytes, bool]:
        """Send one request and read its answer: (status, body, whether the connection stays open)."""
        self.transport.write(head + content if content else head)
        while True:
            end = self.data.find(b"\r\n\r\n")
            while end < 0:
                if len(self.data) > MAX_HEAD:
                    raise Dropped(f"an answer's headers were longer than {MAX_HEAD} bytes")
                await self.more(timeout)
                end = self.data.find(b"\r\n\r\n")
            lines = bytes(self.data[:end]).split(b"\r\n")
            del self.data[:end + 4]
            version, _, rest = lines[0].partition(b" ")
            try:
                status = int(rest[:3])
            except ValueError:
                raise Dropped(f"not an HTTP answer: {lines[0][:80]!r}") from None
            if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
                continue
            break
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip().lower()
        connection = fields.get(b"connection", b"")
        keep = b"close" not in connection if version == b"HTTP/1.1" else b"keep-alive" in connection
        if method == "HEAD" or status in _NO_BODY_STATUS:
            return status, b"", keep
        if b"chunked" in fields.get(b"transfer-encoding", b""):
            return status, await self._chunked(timeout), keep
        length = fields.get(b"content-length")
        if length is None:  # up to the close
            while not self.closed:
                await self.more(timeout)
            body, self.data = bytes(self.data), bytearray()
            return status, body, False
        try:
            size = int(length)
        except ValueError:
            raise Dropped(f"a bad Content-Length: {length[:40]!r}") from None
        while len(self.data) < size:
            await self.more(timeout)
        body = bytes(self.data[:size])
        del self.data[:size]
        return status, body, keep

    async def _chunked(self, timeout: float) -> bytes:
        parts = []
        while True:
            end = self.data.find(b"\r\n")
            while end < 0:
                await self.more(timeout)
                end = self.data.find(b"\r\n")
            try:
                size = int(bytes(self.data[:end]).split(b";", 1)[0], 16)
            except ValueError:
                raise Dropped("a bad chunk size in a chunked answer") from None
            del self.data[:end + 2]
            if size == 0:  # the last chunk; then trailers, up to an empty line
                while True:
                    end = self.data.find(b"\r\n")
                    while end < 0:
                        await self.more(timeout)
                        end = self.data.find(b"\r\n")
                    del self.data[:end + 2]
                    if end == 0:
                        return b"".join(parts)
            while len(self.data) < size + 2:
                await self.more(timeout)
            parts.append(bytes(self.data[:size]))
            del self.data[:size + 2]


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(Timeout("no answer in time"))


_BAD_TARGET = re.compile("[\x00-\x20\x7f]")  # what http.client refuses in a request target
_BAD_HEADER = re.compile("[\r\n\x00]")


def _checked(text: str, bad: re.Pattern, what: str) -> str:
    """``text`` unless it would break the request apart (http.client refuses it too)."""
    if bad.search(text):
        raise ValueError(f"{what} may not contain control characters or spaces: {text!r}")
    return text


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
        self._slots = asyncio.Semaphore(size)
        self._size = size
        self.closed = False

    async def request(self, method: str, target: str, headers: dict, content: bytes | None,
                      timeout: float) -> tuple[int, bytes]:
        """(status, body) of one exchange. An exception from ``_connect`` means nothing was sent."""
        head = [f"{method} {_checked(target, _BAD_TARGET, 'a request target')} HTTP/1.1", f"Host: {self._host_header}"]
        head += [f"{_checked(k, _BAD_HEADER, 'a header name')}: {_checked(str(v), _BAD_HEADER, 'a header value')}"
                 for k, v in headers.items()]
        if content or method in _BODY_METHODS:
            head.append(f"Content-Length: {len(content or b'')}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        async with self._slots:
            conn = await self._take(timeout)
            try:
                status, body, keep = await conn.exchange(data, content, method, timeout)
            except BaseException:  # a cancelled or failed exchange may still be answered: never reused
                conn.close()
                raise
            if keep and not conn.closed and not conn.data and not self.closed:
                self._idle.append(conn)
            else:
                conn.close()
            return status, body

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
                server_hostname=self._host if self._ssl else None), timeout)
        except asyncio.TimeoutError:
            raise NotConnected(f"no connection to {self._host}:{self._port} within {timeout:g} s") from None
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
