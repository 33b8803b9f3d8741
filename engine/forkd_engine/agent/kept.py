"""Short agent calls from an event loop (the server's pings) on kept connections.

A new connection per call cost the server a fifth of its CPU per gathered ping (a socket made,
connected, watched, unwatched and closed) and the agent half of its own (an accept, a close). So each
agent process gets one connection, kept open, that carries every short call of one event loop;
requests are pipelined and the agent answers a connection's requests one by one, in order
(``server.py``), so the n-th reply is the n-th request's. A reply that comes after its caller gave
up (a timeout) is read and dropped in its turn.

A connection is bound to one agent process, the key its caller gives (its socket path, pid and
start time): another process at the same path (a sandbox woken, a new agent) gets a connection of
its own, and none outlives its agent: the agent's end closes it (a fork of the agent closes the
copies it inherits, ``inventory.connections_to``), and its callers learn it as they would have on
a new connection. The replies and errors are ``AgentClient.call``'s, the deadline over the whole
exchange; ``BlockingIOError`` where ``call`` would wait (the agent's listen queue is full).
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import weakref

import orjson

from .client import AgentUnavailable
from .server import MAX_LINE, encode_line

KEPT = 128  # idle connections kept per loop, the least recently used closed past it


class KeptConnections:
    """The kept connections of each event loop (a connection serves the loop that opened it)."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def call(self, key, path: str, request: dict | bytes, timeout: float, alone: bool = False) -> dict:
        """The agent's reply to ``request``, on the connection kept for ``key`` (opened if none).
        ``request`` may be its line already encoded (``encode_line``): a call made again and
        again (a ping) is encoded once. ``alone``: the connection carries one call at a time (long
        calls, which may run on after their caller gave up): a call given up on (its timeout, or
        its caller cancelled) closes it, so the next call is not queued behind an answer nobody
        waits for."""
        loop = asyncio.get_running_loop()
        lines = self._by_loop.get(loop)
        if lines is None:
            lines = self._by_loop[loop] = _Lines(loop, self.kept)
        return await lines.call(key, path, request, timeout, alone)

    def open_count(self) -> int:
        """Connections open, on every loop."""
        return sum(len(lines.open) for lines in list(self._by_loop.values()))

    def close(self) -> None:
        """Close every connection (from any thread: each on its own loop, if that still runs)."""
        for loop, lines in list(self._by_loop.items()):
            if loop.is_closed():  # its transports can no longer close: their sockets are closed here
                lines.abandon()
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                lines.close()
            else:
                loop.call_soon_threadsafe(lines.close)


class _Lines:
    """One loop's connections, by key, the most recently used last."""

    def __init__(self, loop: asyncio.AbstractEventLoop, kept: int):
        self.loop = loop
        self.kept = kept
        self.open: collections.OrderedDict = collections.OrderedDict()
        self._attaching: set[asyncio.Task] = set()  # held: the loop keeps only weak references

    async def call(self, key, path: str, request: dict | bytes, timeout: float, alone: bool) -> dict:
        conn = self.open.get(key)
        if conn is None:
            conn = self._connect(key, path)
        else:
            self.open.move_to_end(key)
        reply = conn.send(request if isinstance(request, bytes) else encode_line(request), timeout)
        try:
            line = await reply
        except TimeoutError as exc:  # said as call() says it (a TimeoutError its cause)
            if alone:
                conn.close()
            raise AgentUnavailable(f"agent at {path} did not answer within {timeout:g} s") from exc
        except asyncio.CancelledError:
            if alone:
                conn.close()
            raise
        return _decode(line)

    def _connect(self, key, path: str) -> _Connection:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.setblocking(False)
            s.connect(path)  # a Unix socket connects at once, or says EAGAIN: its queue is full
        except BlockingIOError:
            s.close()
            raise
        except OSError as exc:
            s.close()
            raise AgentUnavailable(f"agent at {path} unreachable: {exc.strerror or exc}") from exc
        conn = self.open[key] = _Connection(path, s, lambda: self._forget(key, conn))
        # the transport is made on the loop's next turn; what is sent meanwhile waits in conn
        task = self.loop.create_task(self._attach(conn, s))
        self._attaching.add(task)
        task.add_done_callback(self._attaching.discard)
        self._trim(but=key)
        return conn

    async def _attach(self, conn: _Connection, s: socket.socket) -> None:
        try:
            await self.loop.create_unix_connection(lambda: conn, sock=s)
        except OSError as exc:
            s.close()
            conn.fail(AgentUnavailable(f"agent at {conn.path} unreachable: {exc.strerror or exc}"))

    def _forget(self, key, conn: _Connection) -> None:
        if self.open.get(key) is conn:
            del self.open[key]

    def close(self) -> None:
        for conn in list(self.open.values()):
            conn.fail(AgentUnavailable(f"agent at {conn.path}: the connection was closed"))

    def abandon(self) -> None:
        """Close the sockets of a loop that is closed."""
        for conn in list(self.open.values()):
            conn.closed = True
            conn.sock.close()
        self.open.clear()

    def _trim(self, but) -> None:
        """Close idle connections but the one just made (``but``), the least recently used first,
        while more than ``kept`` are open (past it while all are busy)."""
        for key in list(self.open):
            if len(self.open) <= self.kept:
                return
            conn = self.open[key]
            if key != but and not conn.waiting:
                conn.close()


def _decode(line: bytes) -> dict:
    """A reply line, as ``json.loads`` reads it: by orjson, six times faster, and by json where
    orjson refuses what json takes (NaN, an integer past 64 bits)."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


class _Connection(asyncio.Protocol):
    """One kept connection: requests out, reply lines in, matched in order.

    Each request has a deadline; one timer per connection, set for the earliest, ends those whose
    deadline has passed (``TimeoutError``) and is set again for the next. A timer per request,
    made and cancelled around each ping, was a tenth of the loop's own work for a ping."""

    def __init__(self, path: str, sock: socket.socket, forget):
        self.path = path
        self.sock = sock
        self._forget = forget
        self.transport: asyncio.Transport | None = None
        self._unsent: list[bytes] = []  # lines not yet written (this turn's, or before the transport)
        # (reply future, deadline on the loop's clock, its timeout in s): one per request, in order
        self.waiting: collections.deque[tuple[asyncio.Future, float, float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None  # set for the earliest deadline waiting
        self._buf = b""
        self.closed = False

    def send(self, data: bytes, timeout: float) -> asyncio.Future:
        """Send one request line; the future of its reply line, which fails with ``TimeoutError``
        once ``timeout`` s have passed without it. The lines sent in one turn of the loop (a
        gathered batch) go out in one write at its end: one wake-up of the agent, not one each."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if self.closed:
            reply.set_exception(self._gone())
            return reply
        deadline = loop.time() + timeout
        self.waiting.append((reply, deadline, timeout))
        if self._timer is None or deadline < self._timer.when():
            self._set_timer(deadline)
        self._unsent.append(data)
        if len(self._unsent) == 1 and self.transport is not None:
            loop.call_soon(self._flush)
        return reply

    def _set_timer(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        """End the requests whose deadline has passed (their replies, when they come, are dropped in
        their turn); the timer is set again for the earliest one left."""
        self._timer = None
        now = asyncio.get_running_loop().time()
        earliest = None
        for reply, deadline, seconds in self.waiting:
            if reply.done():
                continue
            if deadline <= now:
                reply.set_exception(TimeoutError(f"{seconds:g} s passed"))
            elif earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None:
            self._set_timer(earliest)

    def _flush(self) -> None:
        if self._unsent and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self._unsent))
        self._unsent = []

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.closed:  # closed (trimmed) before it was attached
            transport.close()
            return
        self._flush()

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        start = 0
        while True:
            end = buf.find(b"\n", start)
            if end < 0:
                break
            line, start = buf[start:end], end + 1
            if self.waiting:
                reply = self.waiting.popleft()[0]
                if not reply.done():  # else its caller gave up: the reply is dropped in its turn
                    reply.set_result(line)
        self._buf = buf[start:]
        if len(self._buf) > MAX_LINE:
            self.fail(AgentUnavailable(f"agent reply larger than {MAX_LINE} bytes"))

    def connection_lost(self, exc) -> None:
        self.fail(self._gone())

    def _gone(self) -> AgentUnavailable:
        return AgentUnavailable(f"agent at {self.path} closed the connection without a reply")

    def fail(self, error: Exception) -> None:
        """Close the connection; every request still waiting gets ``error``."""
        self.close()
        while self.waiting:
            reply = self.waiting.popleft()[0]
            if not reply.done():
                reply.set_exception(error)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._forget()
            if self.transport is not None:
                self.transport.close()
