"""Streaming sessions in the client SDK: a WebSocket to ``/v1/sandboxes/{id}/session``.

The conversation the forkd kernel has with its sandbox, and what ``Sandbox.run_code`` uses so a
cell's output arrives as it is printed and an interrupt stops it::

    with Session(controller, "sb-...") as s:
        reply = s.execute("for i in range(3): print(i)", on_event=print)

    async with AsyncSession(async_controller, "sb-...") as s:
        reply = await s.execute("for i in range(3): print(i)", on_event=print)

What is said is written once (``forkd_server.client._cells``); ``Session`` says it over
``websocket-client`` (a dependency of jupyter_server, so it is there wherever forkd is),
``AsyncSession`` over aiohttp.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import urllib.parse
from typing import Any, Callable

import websocket

from .client import _async, _cells, _sync
from .client._errors import ControllerError, ServerUnreachable, SessionClosed

__all__ = ["AsyncSession", "Session", "SessionClosed"]

_ids = itertools.count(1)


def _where(controller, sandbox_id: str, shell: str) -> tuple[str, dict]:
    base = urllib.parse.urlsplit(controller.base_url)
    scheme = "wss" if base.scheme == "https" else "ws"
    query = urllib.parse.urlencode({"shell": shell})
    url = f"{scheme}://{base.netloc}{base.path}/v1/sandboxes/{sandbox_id}/session?{query}"
    return url, controller.headers()  # its token and its client id


def _refused(status: int, body: bytes | None, url: str) -> ControllerError:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        parsed = (body or b"").decode("utf-8", "replace")
    return ControllerError(status, parsed, url)


class _Calls:
    """What a session can be asked, written once; ``_do`` (run it) and ``_stream`` (iterate it)
    are the sync or async driver's."""

    sandbox_id: str

    def new_id(self) -> str:
        return f"{self._prefix}{next(_ids)}"

    def interrupt(self):
        """Raise KeyboardInterrupt in the cell the sandbox is running (its reply comes as an event)."""
        return self.send({"type": "interrupt", "id": self.new_id()})

    def request(self, kind: str, on_event: Callable[[dict], Any] | None = None,
                timeout: float | None = None, **fields):
        """Send one request and return its reply's content; events on the way go to ``on_event``.
        Only one caller may read at a time (this one, until its reply)."""
        return self._do(_cells.request(self, kind, on_event, timeout, **fields))

    def stream(self, code: str, timeout: float | None = None, **options):
        """Run a cell and yield its events as they happen; the last one is its ``execute_reply``
        (``{"type": "execute_reply", "content": {"status", ...}}``). Stop it with ``interrupt()``;
        leaving the loop early interrupts it too."""
        return self._stream(_cells.stream(self, code, timeout, **options))

    def execute(self, code: str, *, on_event: Callable[[dict], Any] | None = None,
                input: Callable[[str, bool], str] | None = None, timeout: float | None = None,  # noqa: A002
                **options):
        """Run a cell; its output events go to ``on_event`` as they happen; returns the reply.
        ``input(prompt, password)`` answers the cell's ``input()``. After ``timeout`` the cell is
        interrupted; if it still has not finished 2 s later, ``TimeoutError``."""
        return self._do(_cells.execute(self, code, on_event=on_event, input=input, timeout=timeout, **options))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sandbox_id!r}, shell={getattr(self, 'shell', '?')!r})"


class Session(_Calls):
    def __init__(self, controller, sandbox_id: str, *, shell: str = "plain", timeout: float = 120.0):
        self.sandbox_id = sandbox_id
        self.url, headers = _where(controller, sandbox_id, shell)
        self._prefix = f"{os.getpid()}-{id(self):x}-"
        try:
            # TCP_NODELAY: a cell's small messages must not wait for delayed ACKs (40 ms each)
            self._ws = websocket.create_connection(self.url, header=[f"{k}: {v}" for k, v in headers.items()],
                                                   timeout=timeout, enable_multithread=True, suppress_origin=True,
                                                   sockopt=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),))
        except websocket.WebSocketBadStatusException as exc:
            raise _refused(exc.status_code, exc.resp_body, self.url) from None
        except (OSError, websocket.WebSocketException) as exc:
            raise ServerUnreachable(controller.base_url, exc) from None
        try:
            self.hello: dict = _cells.check_hello(sandbox_id, self.recv(timeout))
        except BaseException:
            self.close()
            raise
        self.shell: str = self.hello.get("shell", "plain")
        self.closed = False

    _do = staticmethod(_sync.run)
    _stream = staticmethod(_sync.stream)

    def send(self, message: dict) -> None:
        try:
            self._ws.send(json.dumps(message))
        except (OSError, websocket.WebSocketException) as exc:
            self.closed = True
            raise SessionClosed(f"the session with {self.sandbox_id} is closed ({exc})") from None

    def recv(self, timeout: float | None = None) -> dict | None:
        """The next message, or None once the session has ended. ``TimeoutError`` after ``timeout``."""
        try:
            self._ws.settimeout(timeout)
            data = self._ws.recv()
        except (websocket.WebSocketTimeoutException, socket.timeout):
            raise TimeoutError(f"nothing from {self.sandbox_id} within {timeout:g} s") from None
        except (OSError, websocket.WebSocketConnectionClosedException):
            self.closed = True
            return None
        if not data:
            self.closed = True
            return None
        return json.loads(data)

    def close(self) -> None:
        self.closed = True
        try:
            self._ws.close()
        except (OSError, websocket.WebSocketException):
            pass

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSession(_Calls):
    """The same session for asyncio: ``async with AsyncSession(ctl, id) as s`` (or ``await``
    it) connects; ``request``/``execute``/``interrupt`` are awaited; ``async for event in s.stream(code)``.
    Cancelling the task that awaits ``execute`` (or iterates ``stream``) interrupts the cell."""

    def __init__(self, controller, sandbox_id: str, *, shell: str = "plain", timeout: float = 120.0):
        self.sandbox_id, self._controller, self._timeout = sandbox_id, controller, timeout
        self.url, self._headers = _where(controller, sandbox_id, shell)
        self._prefix = f"{os.getpid()}-{id(self):x}-"
        self._ws = self._http = None
        self.closed = True

    async def open(self) -> "AsyncSession":
        if self._ws is not None:
            return self
        import aiohttp  # the async SDK's one dependency beyond the sync SDK's

        refusal: dict = {}

        async def keep_refusal(_http, _ctx, params) -> None:  # aiohttp drops a refused upgrade's body
            if params.response.status != 101:
                refusal["body"] = await params.response.read()

        trace = aiohttp.TraceConfig()
        trace.on_request_end.append(keep_refusal)
        # the socket is the session's alone, for its whole life: no total timeout (a session lasts
        # as long as its user wants), ``timeout`` to connect; each recv has its own
        self._http = aiohttp.ClientSession(trace_configs=[trace],
                                           timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout))
        try:
            self._ws = await self._http.ws_connect(self.url, headers=self._headers, autoping=True,
                                                   timeout=aiohttp.ClientWSTimeout(ws_close=2.0),
                                                   max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            await self._http.close()
            raise _refused(exc.status, refusal.get("body"), self.url) from None
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            await self._http.close()
            raise ServerUnreachable(self._controller.base_url, exc) from None
        self.closed = False
        try:
            self.hello = _cells.check_hello(self.sandbox_id, await self.recv(self._timeout))
        except BaseException:
            await self.close()
            raise
        self.shell = self.hello.get("shell", "plain")
        return self

    def __await__(self):
        return self.open().__await__()

    _do = staticmethod(_async.run)
    _stream = staticmethod(_async.stream)

    async def send(self, message: dict) -> None:
        try:
            await self._ws.send_str(json.dumps(message))
        except (OSError, RuntimeError) as exc:  # aiohttp: ClientConnectionResetError, or sending once closed
            self.closed = True
            raise SessionClosed(f"the session with {self.sandbox_id} is closed ({exc})") from None

    async def recv(self, timeout: float | None = None) -> dict | None:
        """The next message, or None once the session has ended. ``TimeoutError`` after ``timeout``."""
        import aiohttp

        try:
            message = await self._ws.receive(timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"nothing from {self.sandbox_id} within {timeout:g} s") from None
        if message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            return json.loads(message.data)
        self.closed = True
        return None

    async def close(self) -> None:
        self.closed = True
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()

    aclose = close

    async def __aenter__(self) -> "AsyncSession":
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

