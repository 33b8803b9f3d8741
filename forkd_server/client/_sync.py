"""The sync SDK's I/O: a pool of kept-alive connections (urllib3) and the driver that performs an
operation's effects (``_core``) by blocking calls."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import urllib3
from urllib3 import exceptions as u3

from ._core import (Close, Emit, NextEvent, OpenSession, Recv, Request, Send, SSEDecoder, Sleep, Subscribe, Wait,
                    Wire)
from ._errors import ServerUnreachable

__all__ = ["EventStream", "SyncTransport", "run", "stream"]


def _kind(exc: Exception) -> str:
    if isinstance(exc, (u3.NewConnectionError, u3.ConnectTimeoutError)):
        return "connect"
    if isinstance(exc, u3.ReadTimeoutError):
        return "timeout"
    if isinstance(exc, u3.ProtocolError):
        return "dropped"
    return "connect"


class SyncTransport(Wire):
    """One pool of connections per controller, kept alive between calls and shared by its threads
    (``max_connections`` of them stay open). A process forked after using it starts a pool of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool = self._pid = None

    def _connections(self):
        if self._pid != os.getpid():  # first use, or a fork: the parent's sockets are not ours to share
            self._pool = urllib3.connection_from_url(self.base_url, maxsize=self.max_connections, block=False,
                                                     retries=False)
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
        while True:
            try:
                resp = pool.urlopen(request.method, request.target, body=request.content, headers=request.headers,
                                    timeout=request.timeout, retries=False, redirect=False, assert_same_host=False)
            except u3.HTTPError as exc:
                error = self.failure(request, _kind(exc), exc.__cause__ or exc, attempt)
                if error is not None:
                    raise error from None
                attempt += 1
                continue
            return self.answer(request, resp.status, resp.data)

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
        value = error = None
        try:
            if type(effect) is Emit:
                if not closing:  # a closed generator may not yield again
                    yield effect.value
            else:
                value = perform(effect, controller)
        except BaseException as exc:  # noqa: BLE001 - raised inside the operation, which decides
            closing = closing or isinstance(exc, GeneratorExit)
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
