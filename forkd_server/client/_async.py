"""The async SDK's I/O: a pool of kept-alive connections (``_http1``), aiohttp for event streams,
and the driver that performs an operation's effects (``_core``) by awaiting them. aiohttp is
imported on first use, so the sync SDK never loads it."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Iterator

from ._core import (Close, Emit, LeftEarly, NextEvent, OpenSession, Recv, Request, Send, SSEDecoder, Sleep,
                    Subscribe, Wait, Wire)

__all__ = ["AsyncEventStream", "AsyncTransport", "run", "stream"]


def _kind(exc: BaseException) -> str:
    import aiohttp

    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return "connect"
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's read timeouts are asyncio.TimeoutErrors too
        return "timeout"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)):
        return "dropped"
    return "connect"


class AsyncTransport(Wire):
    """One connection pool per controller (``_http1``), made in the event loop of its first call
    and kept alive between calls: ``max_connections`` open at most; ``async with`` or ``aclose()``
    closes them. Used from another event loop, it starts a pool of its own there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool = self._loop = None
        self._timeouts: dict[float, Any] = {}

    def _connections(self):
        loop = asyncio.get_running_loop()
        if self._pool is None or self._loop is not loop or self._pool.closed:
            from ._http1 import Pool

            self._loop = loop
            self._pool = Pool(self.base_url, self.max_connections)
        return self._pool

    def _timeout(self, seconds: float):
        timeout = self._timeouts.get(seconds)
        if timeout is None:
            import aiohttp

            # like the sync SDK's socket timeout: for connecting, and for each read
            timeout = self._timeouts[seconds] = aiohttp.ClientTimeout(total=None, sock_connect=seconds,
                                                                     sock_read=seconds)
        return timeout

    async def aclose(self) -> None:
        """Close the kept connections (the controller opens new ones if used again)."""
        if self._pool is not None and self._loop is asyncio.get_running_loop():
            await self._pool.aclose()
        self._pool = self._loop = None

    close = aclose

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _exchange(self, request: Request) -> Any:
        from ._http1 import Dropped, NotConnected, Timeout

        pool = self._connections()
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                status, content, missing = await pool.request(request.method, request.target, request.headers,
                                                              request.content, request.timeout)
            except NotConnected as exc:
                kind, reason = "connect", exc
            except Timeout as exc:
                kind, reason = "timeout", exc
            except (Dropped, OSError) as exc:
                kind, reason = "dropped", exc
            else:
                wait = self.ask_again(request, status, content, started)
                if wait is not None:
                    await asyncio.sleep(wait)
                    continue
                return self.answer(request, status, content, missing)
            error = self.failure(request, kind, reason, attempt)
            if error is not None:
                raise error from None
            attempt += 1

    async def _do(self, step, then=None):
        result = await (self._exchange(step) if isinstance(step, Request) else run(step, self))
        return then(result) if then is not None else result

    def _stream(self, operation: Iterator) -> AsyncIterator:
        return stream(operation, self)

    async def _subscribe(self, request: Request) -> "AsyncEventStream":
        """A long-lived stream gets a connection of its own (never one of the pool's)."""
        import aiohttp
        from yarl import URL

        http = aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=("Accept", "Content-Type"))
        try:
            resp = await http.request(request.method, URL(request.url, encoded=True), headers=request.headers,
                                      timeout=self._timeout(request.timeout))
            if resp.status >= 300:
                content = await resp.read()
                resp.release()
                self.answer(request, resp.status, content)
        except BaseException as exc:
            await http.close()
            if isinstance(exc, (OSError, asyncio.TimeoutError, aiohttp.ClientError)):
                raise self.failure(request, _kind(exc), exc, self.retries) from None
            raise
        return AsyncEventStream(http, resp)


async def perform(effect, controller) -> Any:
    """Do what an operation asks, awaiting it."""
    kind = type(effect)
    if kind is Request:
        return await controller._exchange(effect)
    if kind is Recv:
        return await effect.session.recv(effect.timeout)
    if kind is Send:
        return await effect.session.send(effect.message)
    if kind is Sleep:
        return await asyncio.sleep(effect.seconds)
    if kind is Close:
        return await effect.what.aclose()
    if kind is NextEvent:
        return await anext(effect.stream, None)
    if kind is Subscribe:
        return await controller._subscribe(effect.request)
    if kind is OpenSession:
        return await controller.session(effect.sandbox_id, shell=effect.shell, timeout=effect.timeout).open()
    if kind is Wait:
        return await effect.awaitable
    raise TypeError(f"not an effect: {effect!r}")


async def run(operation: Iterator, controller=None) -> Any:
    """Run an operation to its end; what an effect raises (a cancellation too) is raised inside
    the operation, which may still await effects (interrupting its cell) before re-raising it."""
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
            value = await perform(effect, controller)
        except BaseException as exc:  # noqa: BLE001 - raised inside the operation, which decides
            error = exc


async def stream(operation: Iterator, controller=None) -> AsyncIterator:
    """Run a streaming operation, yielding what it emits (``async for``). A cancelled task, or a
    loop left early, is raised inside the operation, which stops its cell before ending."""
    value = error = None
    closing = False
    while True:
        try:
            effect = operation.throw(error) if error is not None else operation.send(value)
        except StopIteration:
            return
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
                value = await perform(effect, controller)
        except BaseException as exc:  # noqa: BLE001 - raised inside the operation, which decides
            if isinstance(exc, GeneratorExit):
                closing, exc = True, LeftEarly()
            error = exc


class AsyncEventStream:
    """An open ``/v1/events`` subscription: ``async for event in stream``; ``aclose()`` ends it.
    Each next event waits at most the subscription's timeout (``TimeoutError``)."""

    def __init__(self, http, resp):
        self._http, self._resp = http, resp
        self._decoder = SSEDecoder()
        self.closed = False

    def __aiter__(self) -> "AsyncEventStream":
        return self

    async def __anext__(self) -> dict:
        try:
            while True:
                raw = await self._resp.content.readline()
                if not raw:
                    break
                event = self._decoder.line(raw)
                if event is not None:
                    return event
        except Exception:
            if not self.closed:  # a read cut short by aclose() is the end of the stream, not an error
                raise
        await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._resp.close()
        await self._http.close()

    close = aclose

    async def __aenter__(self) -> "AsyncEventStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
