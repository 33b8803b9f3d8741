"""Streaming sessions in the client SDK: a WebSocket to ``/v1/sandboxes/{id}/session``.

The conversation the forkd kernel has with its sandbox, and what ``Sandbox.run_code`` uses so a
cell's output arrives as it is printed and an interrupt stops it::

    with Session(controller, "sb-...") as s:
        reply = s.execute("for i in range(3): print(i)", on_event=print)

Messages are JSON objects both ways (see ``forkd_engine/agent/session.py`` for the types). Needs
``websocket-client`` (a dependency of jupyter_server, so it is there wherever forkd is).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable

import websocket

__all__ = ["Session", "SessionClosed"]

_ids = itertools.count(1)


class SessionClosed(ConnectionError):
    """The session ended: the sandbox was killed, exited, or the server went away."""


class Session:
    def __init__(self, controller, sandbox_id: str, *, shell: str = "plain", timeout: float = 120.0):
        from .client import ControllerError, ServerUnreachable  # the SDK module imports this one lazily

        self.sandbox_id = sandbox_id
        base = urllib.parse.urlsplit(controller.base_url)
        scheme = "wss" if base.scheme == "https" else "ws"
        query = urllib.parse.urlencode({"shell": shell})
        self.url = f"{scheme}://{base.netloc}{base.path}/v1/sandboxes/{sandbox_id}/session?{query}"
        headers = [f"{name}: {value}" for name, value in controller.headers().items()]
        self._prefix = f"{os.getpid()}-{id(self):x}-"
        try:
            # TCP_NODELAY: a cell's small messages must not wait for delayed ACKs (40 ms each)
            self._ws = websocket.create_connection(self.url, header=headers, timeout=timeout,
                                                   enable_multithread=True, suppress_origin=True,
                                                   sockopt=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),))
        except websocket.WebSocketBadStatusException as exc:
            try:
                body = json.loads(exc.resp_body or b"{}")
            except ValueError:
                body = (exc.resp_body or b"").decode("utf-8", "replace")
            raise ControllerError(exc.status_code, body, self.url) from None
        except (OSError, websocket.WebSocketException) as exc:
            raise ServerUnreachable(controller.base_url, exc) from None
        hello = self.recv(timeout)
        if hello is None or hello.get("type") != "session_reply":
            self.close()
            raise SessionClosed(f"session with {sandbox_id} did not start: {hello!r}")
        self.hello: dict = hello.get("content") or {}
        self.shell: str = self.hello.get("shell", "plain")
        self.closed = False

    def __repr__(self) -> str:
        return f"Session({self.sandbox_id!r}, shell={getattr(self, 'shell', '?')!r})"

    # --- transport -------------------------------------------------------------------------------

    def new_id(self) -> str:
        return f"{self._prefix}{next(_ids)}"

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

    # --- requests --------------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in the cell the sandbox is running (its reply comes as an event)."""
        self.send({"type": "interrupt", "id": self.new_id()})

    def request(self, kind: str, on_event: Callable[[dict], Any] | None = None,
                timeout: float | None = None, **fields) -> dict:
        """Send one request and return its reply's content; events on the way go to ``on_event``.
        Only one caller may read at a time (this one, until its reply)."""
        rid = self.new_id()
        self.send({"type": kind, "id": rid, **fields})
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            event = self.recv(left)
            if event is None:
                raise SessionClosed(f"the session with {self.sandbox_id} ended before its {kind} reply "
                                    f"(was the sandbox killed?)")
            if event.get("type") == f"{kind}_reply" and event.get("id") == rid:
                return event.get("content") or {}
            if on_event is not None:
                on_event(event)

    def stream(self, code: str, **options):
        """Run a cell and yield its events as they happen; the last one is its ``execute_reply``
        (``{"type": "execute_reply", "content": {"status", ...}}``). Stop it with ``interrupt()``."""
        rid = self.new_id()
        self.send({"type": "execute", "id": rid, "code": code, **options})
        while True:
            event = self.recv()
            if event is None:
                raise SessionClosed(f"the session with {self.sandbox_id} ended during the cell")
            yield event
            if event.get("type") == "execute_reply" and event.get("id") == rid:
                return

    def execute(self, code: str, *, on_event: Callable[[dict], Any] | None = None,
                input: Callable[[str, bool], str] | None = None, timeout: float | None = None,  # noqa: A002
                **options) -> dict:
        """Run a cell; its output events go to ``on_event`` as they happen; returns the reply.
        ``input(prompt, password)`` answers the cell's ``input()``. After ``timeout`` the cell is
        interrupted; if it still has not finished 2 s later, ``TimeoutError``."""
        interrupted = threading.Event()

        def handle(event: dict) -> None:
            if event.get("type") == "input_request" and input is not None:
                self.send({"type": "input_reply", "value": input(event.get("prompt", ""),
                                                                   bool(event.get("password")))})
            elif on_event is not None:
                on_event(event)

        fields = dict(options, code=code, allow_stdin=input is not None)
        if timeout is None:
            return self.request("execute", handle, **fields)
        rid = self.new_id()
        self.send({"type": "execute", "id": rid, **fields})
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                event = self.recv(max(0.0, left))
            except TimeoutError:
                if interrupted.is_set():
                    raise TimeoutError(f"the cell in {self.sandbox_id} ran past {timeout:g} s and did not stop "
                                       f"when interrupted") from None
                interrupted.set()
                self.interrupt()
                deadline = time.monotonic() + 2.0
                continue
            if event is None:
                raise SessionClosed(f"the session with {self.sandbox_id} ended during the cell")
            if event.get("type") == "execute_reply" and event.get("id") == rid:
                return event.get("content") or {}
            handle(event)
