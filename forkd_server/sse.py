"""Server-sent events over tornado: the server's ``/v1/events`` and the router's merged stream."""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, Callable

from tornado.iostream import StreamClosedError


class EventStream:
    """A ``RequestHandler`` mixin: ``stream_events`` sends what a subscription to ``hub`` (its
    ``subscribe``/``unsubscribe``, an asyncio queue each, ``None`` to end) gives, one event per
    ``id:``/``event:``/``data:`` block, with a comment line every ``keepalive`` s of silence;
    ``visible`` (which may be async) says which events this subscriber gets."""

    _queue = None

    async def stream_events(self: Any, hub, greeting: str, keepalive: float,
                            visible: Callable[[dict], bool] | None = None,
                            encode: Callable[[dict], str] = json.dumps) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        self._queue = queue = hub.subscribe()
        try:
            self.write(f": {greeting}\n\n")
            await self.flush()
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), keepalive)
                except asyncio.TimeoutError:
                    self.write(": keep-alive\n\n")
                    await self.flush()
                    continue
                if event is None:  # the server or the client is going away
                    break
                if visible is not None:
                    seen = visible(event)
                    if inspect.isawaitable(seen):  # the router may have to ask a host whose it is
                        seen = await seen
                    if not seen:
                        continue
                self.write(f"id: {event['seq']}\nevent: {event.get('kind')}\ndata: {encode(event)}\n\n")
                await self.flush()
        except StreamClosedError:
            pass
        finally:
            hub.unsubscribe(queue)
        if not self.request.connection.stream.closed():
            self.finish()

    def on_connection_close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)
