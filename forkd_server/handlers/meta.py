"""Meta routes: health, version, Prometheus metrics, the OpenAPI document, server-sent events and
the lineage tree."""

from __future__ import annotations

import asyncio
import json
import os

from jupyter_server.auth.decorator import allow_unauthenticated, authorized
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from tornado import web
from tornado.iostream import StreamClosedError

from .. import __version__
from ..errors import ForkdError
from .base import ForkdHandler, dumps, query_bool, query_labels

OPENAPI_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "openapi.json")


class HealthHandler(ForkdHandler):
    public = True

    @allow_unauthenticated
    def get(self) -> None:
        self.send({"ok": True})


class VersionHandler(ForkdHandler):
    @web.authenticated
    @authorized
    def get(self) -> None:
        self.send({"version": __version__, "api": "v1"})


class MetricsHandler(ForkdHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        text = await self.call(generate_latest, self.app.metrics.registry)
        self.finish(text, set_content_type=CONTENT_TYPE_PLAIN_0_0_4)


class OpenAPIHandler(ForkdHandler):
    @web.authenticated
    @authorized
    def get(self) -> None:
        with open(OPENAPI_PATH) as f:
            doc = json.load(f)
        doc["servers"] = [{"url": self.base_url.rstrip("/") + "/" + self.app.route_prefix.rstrip("/")}]
        self.send(doc)


class EventsHandler(ForkdHandler):
    """Server-sent events: one ``data:`` line of JSON per change (created, status, killed, deleted)."""

    auth_resource = "forkd:events"
    _queue = None

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        hub = self.app.events
        self._queue = queue = hub.subscribe()
        try:
            self.write(": forkd events\n\n")
            await self.flush()
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), self.app.sse_keepalive)
                except asyncio.TimeoutError:
                    self.write(": keep-alive\n\n")
                    await self.flush()
                    continue
                if event is None:  # the server or the client is going away
                    break
                self.write(f"id: {event['seq']}\nevent: {event['kind']}\ndata: {dumps(event).decode()}\n\n")
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


class TreeHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        with_memory, with_busy = query_bool(self, "memory"), query_bool(self, "busy")
        nodes = await self.call(self.controller.tree, query_labels(self))
        sandboxes = [n for n in nodes if n["kind"] == "sandbox"]
        # one request for the whole tree instead of one per sandbox (the lab panel shows all of them)
        if with_memory:
            await self.call(self._add_memory, sandboxes)
        if with_busy:  # one agent round trip each, side by side: a slow sandbox costs its own ping only
            await asyncio.gather(*(self.call(self._add_busy, n) for n in sandboxes))
        self.send(nodes)

    def _add_memory(self, sandboxes: list[dict]) -> None:
        for node in sandboxes:
            try:
                node["memory"] = self.controller.memory(node["id"])
            except ForkdError:  # gone since the listing: the event says so
                node["memory"] = None

    def _add_busy(self, node: dict) -> None:
        try:
            node["busy"] = self.controller.ping(node["id"]).get("busy")
        except ForkdError:
            node["busy"] = None
