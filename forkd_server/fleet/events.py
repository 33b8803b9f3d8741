"""One ``/v1/events`` for the fleet: every up host's server-sent events, each with its ``host``,
numbered again (``seq``) by the router, plus the router's own: a host going ``down`` or ``up``
(``kind: host``) and each sandbox of a host that went down (``kind: sandbox, action: lost``).

A reader per up host follows its stream and reconnects while the host is up; events also keep the
pins current for objects made on a host directly (``on_event``), and each time a stream opens the
router reads the host's listings (``on_connect``) for what it may have missed. While a host's stream
is open, its snapshot listing stays current until a snapshot event says otherwise (``Host.changed``):
placement uses it without reading it again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from .hosts import Host

log = logging.getLogger("forkd.router")

QUEUE_SIZE = 10_000  # events a slow subscriber may fall behind before it is cut off
SILENT = 60.0  # s a host's stream may say nothing (it says ": keep-alive" every 15 s) before it is opened again


class EventHub:
    def __init__(self, on_event=None, on_connect=None):
        self.subscribers: set[asyncio.Queue] = set()
        self.seq = 0
        self.on_event, self.on_connect = on_event, on_connect
        self.readers: dict[str, asyncio.Task] = {}
        self.closed = False

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)

    def publish(self, event: dict) -> None:
        self.seq += 1
        event = {**event, "seq": self.seq}
        event.setdefault("time", time.time())
        for q in list(self.subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # too far behind: end its stream (it reconnects and lists again)
                self.subscribers.discard(q)
                _end(q)

    def unfollow(self, host: Host) -> None:
        """Stop reading ``host``'s events (it is down: its connection may hang rather than break)."""
        task = self.readers.pop(host.url, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        self.closed = True  # the readers' loops end on it (a cancel alone may be taken for a timeout)
        for q in list(self.subscribers):
            _end(q)
        for task in self.readers.values():
            task.cancel()

    # --- following the hosts ----------------------------------------------------------------------

    def follow(self, host: Host, retry: float) -> None:
        """Start reading ``host``'s events (once; the reader ends by itself when the host is down)."""
        task = self.readers.get(host.url)
        if task is None or task.done():
            self.readers[host.url] = asyncio.ensure_future(self._read(host, retry))

    async def _read(self, host: Host, retry: float) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=SILENT)
        while host.up and not self.closed:
            try:
                async with host.control.get(host.url + "/v1/events", timeout=timeout) as resp:
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    host.events_open = True  # from here on no change of its snapshots goes unseen
                    host.changed()
                    if self.on_connect is not None:  # what happened while it was not followed
                        asyncio.ensure_future(self.on_connect(host))
                    data: list[str] = []
                    async for raw in resp.content:
                        line = raw.decode("utf-8", "replace").rstrip("\r\n")
                        if line.startswith("data:"):
                            data.append(line[5:].lstrip())
                        elif not line and data:
                            self._got(host, "\n".join(data))
                            data = []
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the host went away or said garbage: follow again
                log.debug("events of %s: %s", host.url, exc)
            finally:
                host.events_open = False
                host.changed()
            if host.up and not self.closed:
                await asyncio.sleep(retry)

    def _got(self, host: Host, data: str) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            return  # not JSON: a host speaking garbage is not passed on
        if not isinstance(event, dict):
            return
        event.pop("seq", None)
        event["host"] = host.url
        if self.on_event is not None:
            try:
                self.on_event(host, event)
            except Exception:  # noqa: BLE001 - a bad event must not end the stream
                log.exception("event from %s", host.url)
        self.publish(event)


def _end(q: asyncio.Queue) -> None:
    try:
        q.put_nowait(None)
    except asyncio.QueueFull:
        q.get_nowait()
        q.put_nowait(None)
