"""The sync SDK's I/O: kept-alive connections (the standard library's ``http.client``, pooled
here) and the driver that performs an operation's effects (``_core``) by blocking calls.

Why not urllib3's pool: it costs ~95 µs of CPU a call on top of http.client's own ~90 µs
(measured on this project's machines), 8% of a ping; this pool adds a lock and one poll()."""

from __future__ import annotations

import http.client
import os
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator
from urllib.parse import urlsplit

from ._core import (CONNECT_TIMEOUT, MISSING_HEADER, Close, Emit, LeftEarly, NextEvent, OpenSession, Recv, Request,
                    Send, SSEDecoder, Sleep, Subscribe, Wait, Wire)
from ._errors import ServerUnreachable

__all__ = ["EventStream", "SyncTransport", "run", "stream"]


class _Connections:
    """Kept-alive connections to one server, shared by threads. Idle ones wait in a stack (the
    most recently used is taken first: the least likely to have been closed by the server); at
    most ``size`` are kept; one the server closed meanwhile is dropped before it is used."""

    def __init__(self, base_url: str, size: int):
        split = urlsplit(base_url)
        self._https = split.scheme == "https"
        self._host, self._port = split.hostname, split.port
        self._size = size
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self, timeout: float) -> http.client.HTTPConnection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if _open(conn.sock):
                    conn.sock.settimeout(timeout)
                    return conn
                conn.close()
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self._size:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _open(sock) -> bool:
    """An idle kept connection is usable if nothing is waiting on it (the server's close would be)."""
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


class SyncTransport(Wire):
    """One pool of connections per controller, kept alive between calls and shared by its threads
    (``max_connections`` of them stay open). A process forked after using it starts a pool of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool = self._pid = None
        self._pool_lock = threading.Lock()

    def _connections(self) -> _Connections:
        if self._pid != os.getpid():  # first use, or a fork: the parent's sockets are not ours to share
            with self._pool_lock:
                if self._pid != os.getpid():
                    self._pool = _Connections(self.base_url, self.max_connections)
                    self._pid = os.getpid()
        return self._pool

    def close(self) -> None:
        """Close the kept connections (the controller opens new ones if used again)."""
        if self._pool is not None and self._pid == os.getpid():
            self._pool.close()
        self._pool = self._pid = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _exchange(self, request: Request) -> Any:
        pool = self._connections()
        attempt = 0
        started = time.monotonic()
        while True:
            conn = pool.take(request.timeout)
            try:
                kind = "connect"
                if conn.sock is None:
                    conn.timeout = min(CONNECT_TIMEOUT, request.timeout)
                    conn.connect()
                    conn.sock.settimeout(request.timeout)
                kind = "dropped"
                conn.request(request.method, request.target, body=request.content, headers=request.headers)
                resp = conn.getresponse()
                content = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if isinstance(exc, TimeoutError) and kind != "connect":
                    kind = "timeout"
                error = self.failure(request, kind, exc, attempt)
                if error is not None:
                    raise error from None
                attempt += 1
                continue
            if resp.will_close:
                conn.close()
            else:
                pool.give_back(conn)
            wait = self.ask_again(request, resp.status, content, started)
            if wait is not None:
                time.sleep(wait)
                continue
            return self.answer(request, resp.status, content, resp.getheader(MISSING_HEADER))

    def _do(self, step, then=None):
        result = self._exchange(step) if isinstance(step, Request) else run(step, self)
        return then(result) if then is not None else result

    def _stream(self, operation: Iterator) -> Iterator:
        return stream(operation, self)

    def _subscribe(self, request: Request) -> "EventStream":
        """A long-lived stream gets a connection of its own (never one of the pool's)."""
        req = urllib.request.Request(request.url, data=request.content, headers=request.headers,
                                     method=request.method)
        try:
            resp = urllib.request.urlopen(req, timeout=request.timeout)  # noqa: S310 - the server's URL
        except urllib.error.HTTPError as exc:
            status, content = exc.code, exc.read()
            exc.close()
            self.answer(request, status, content)  # raises the ControllerError
            raise
        except urllib.error.URLError as exc:  # no connection
            raise self.failure(request, "connect", exc.reason, 0) from None
        except TimeoutError as exc:  # connected and asked, but no answer in time
            raise self.failure(request, "timeout", exc, 0) from None
        except ConnectionError as exc:
            raise ServerUnreachable(self.base_url, exc) from None
        return EventStream(resp)


def perform(effect, controller) -> Any:
    """Do what an operation asks, blocking until it is done."""
    kind = type(effect)
    if kind is Request:
        return controller._exchange(effect)
    if kind is Recv:
        return effect.session.recv(effect.timeout)
    if kind is Send:
        return effect.session.send(effect.message)
    if kind is Sleep:
        return time.sleep(effect.seconds)
    if kind is Close:
        return effect.what.close()
    if kind is NextEvent:
        return next(effect.stream, None)
    if kind is Subscribe:
        return controller._subscribe(effect.request)
    if kind is OpenSession:
        return controller.session(effect.sandbox_id, shell=effect.shell, timeout=effect.timeout)
    if kind is Wait:
        effect.awaitable.close()  # a coroutine never awaited: close it so Python does not warn twice
        raise TypeError("an async callback needs the async SDK (AsyncSandbox, AsyncController)")
    raise TypeError(f"not an effect: {effect!r}")


def run(operation: Iterator, controller=None) -> Any:
    """Run an operation to its end; what an effect raises is raised inside the operation."""
    value = error = None
    while True:
        try:
            effect = operation.throw(error) if error is not None else operation.send(value)
        except StopIteration as stop:
            return stop.value
        value = error = None
        if type(effect) is Emit:
            raise TypeError("a streaming operation needs stream(), not run()")
        try:
            value = perform(effect, controller)
        except BaseException as exc:  # noqa: BLE001 - raised inside the operation, which decides
            error = exc


def stream(operation: Iterator, controller=None) -> Iterator:
    """Run a streaming operation, yielding what it emits. Leaving the loop early (``break``,
    Ctrl-C) is raised inside the operation, which stops what it started (the cell) before ending."""
    value = error = None
    closing = False
    while True:
        try:
            effect = operation.throw(error) if error is not None else operation.send(value)
        except StopIteration as stop:
            return stop.value
        except LeftEarly:
            if closing:
                return  # the operation cleaned up: the loop that left it goes on
            raise
        value = error = None
        try:
            if type(effect) is Emit:
                if not closing:  # a closed generator may not yield again
                    yield effect.value
            else:
                value = perform(effect, controller)
        except BaseException as exc:  # noqa: BLE001 - raised inside the operation, which decides
            if isinstance(exc, GeneratorExit):
                closing, exc = True, LeftEarly()
            error = exc


class EventStream:
    """An open ``/v1/events`` subscription: an iterator of event dicts; ``close()`` ends it."""

    def __init__(self, resp):
        self._resp = resp
        self._lines = iter(resp)
        self._decoder = SSEDecoder()
        self.closed = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> dict:
        try:
            for raw in self._lines:
                event = self._decoder.line(raw)
                if event is not None:
                    return event
        except Exception:
            if not self.closed:  # a read cut short by close() is the end of the stream, not an error
                raise
        self.close()
        raise StopIteration

    def close(self) -> None:
        """End the subscription; a thread blocked reading it sees the end of the stream."""
        if self.closed:
            return
        self.closed = True
        sock = getattr(getattr(getattr(self._resp, "fp", None), "raw", None), "_sock", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks a reader in another thread
        except OSError:
            pass
        self._resp.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
