"""Passing a request on to another forkd (a router to a host, a Jupyter server in remote mode to
its remote) without buffering: the two handler mixins both use.

- ``UpstreamCall``: an HTTP request's call upstream runs as a task that a caller who goes away
  cancels, so a closed browser tab or client ends the upstream request too.
- ``WebSocketRelay``: the caller's WebSocket joined to one opened upstream, message by message.
  The upstream one is opened first (so a refusal reaches the caller with its status); what it says
  before the caller's side is open is kept and passed on, in order, once it is.
"""

from __future__ import annotations

import asyncio

from tornado import httpclient, websocket

MAX_MESSAGE = 256 << 20  # as the session route itself takes


class UpstreamCall:
    """For a ``tornado.web.RequestHandler``."""

    _upstream: asyncio.Future | None = None

    async def call_upstream(self, call) -> None:
        """Await the coroutine ``call``; a caller who goes away cancels it."""
        self._upstream = asyncio.ensure_future(call)
        try:
            await self._upstream
        except asyncio.CancelledError:
            if not self.request.connection.stream.closed():
                raise

    def on_connection_close(self) -> None:
        if self._upstream is not None:
            self._upstream.cancel()


class WebSocketRelay:
    """For a ``tornado.websocket.WebSocketHandler``: put it first among the bases."""

    upstream: websocket.WebSocketClientConnection | None = None
    _early: list | None = None  # what the upstream said before the caller's side was open

    async def open_upstream(self, request: httpclient.HTTPRequest) -> None:
        """Open the upstream WebSocket (raises as ``websocket_connect`` does)."""
        self._early = []
        self.upstream = await websocket.websocket_connect(request, on_message_callback=self._from_upstream,
                                                          max_message_size=MAX_MESSAGE)

    def close_unaccepted(self) -> None:
        """After the upgrade was tried: a caller whose side never opened lets the upstream go."""
        if self.ws_connection is None and self.upstream is not None:
            self.upstream.close()

    def pass_early(self) -> None:
        """From ``open``: what the upstream said meanwhile, then every message as it comes."""
        early, self._early = self._early or [], None
        for message in early:
            self._from_upstream(message)

    def _from_upstream(self, message) -> None:
        if self._early is not None:
            self._early.append(message)
            return
        if message is None:  # the upstream closed it
            self.close(self.upstream.close_code, self.upstream.close_reason)
            return
        try:
            self.write_message(message, binary=isinstance(message, bytes))
        except websocket.WebSocketClosedError:
            if self.upstream is not None:
                self.upstream.close()

    async def on_message(self, message) -> None:
        if self.upstream is not None:
            try:
                await self.upstream.write_message(message, binary=isinstance(message, bytes))
            except websocket.WebSocketClosedError:
                self.close()

    def on_close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
