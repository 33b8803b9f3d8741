"""Meta routes: health, version, Prometheus metrics, the OpenAPI document, server-sent events and
the lineage tree."""

from __future__ import annotations

import functools
import json
import os

from jupyter_server.auth.decorator import allow_unauthenticated, authorized
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from tornado import web

from .. import __version__
from ..controller.tiers import NotRunning
from ..errors import ForkdError
from ..sse import EventStream
from .base import ForkdHandler, dumps, query_bool, query_labels

BUSY_PING_TIMEOUT = 1.0  # s a sandbox has to answer the tree's ping
BUSY_DEADLINE = 3.0      # s for the tree's pings of all sandboxes

OPENAPI_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "openapi.json")


class HealthHandler(ForkdHandler):
    public = True

    @allow_unauthenticated
    async def get(self) -> None:
        # After a restart, while recorded objects are still being settled, how many are left
        # (calls about them answer 503 until then); no figure once all are.
        controller = self.controller
        if controller is None:  # the server is stopping
            self.send({"ok": True})
            return
        left = controller.recovery.pending
        health = {"ok": True, **({"recovering": left} if left else {})}
        if self.current_user is None:  # a probe without a token learns it is up, nothing about its load
            self.send(health)
            return
        # What a router places by (capacity.py): file reads and the registry's cached rows, on a
        # thread of its own (admission.py), so a registry write in progress never holds the event
        # loop and a health check never waits behind control calls.
        block = await self._answer(self.app.admission.health(controller.capacity), None)
        self.send({**health, "capacity": block})


class VersionHandler(ForkdHandler):
    @web.authenticated
    @authorized
    def get(self) -> None:
        self.send({"version": __version__, "api": "v1"})


class MetricsHandler(ForkdHandler):
    auth_resource = "forkd:metrics"
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


class EventsHandler(EventStream, ForkdHandler):
    """Server-sent events: one ``data:`` line of JSON per change (created, status, killed, deleted)."""

    auth_resource = "forkd:events"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        viewer, owners = self.viewer, self.app.event_owners
        visible = None if viewer is None else (  # another user's are not (forkd_server/hub/events.py)
            lambda event: owners is not None and owners.visible(viewer, event))
        await self.stream_events(self.app.events, "forkd events", self.app.sse_keepalive, visible,
                                 lambda event: dumps(event).decode())


class TreeHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        with_memory, with_busy = query_bool(self, "memory"), query_bool(self, "busy")
        nodes = await self.call(self.controller.tree, query_labels(self))
        if self.viewer is not None:
            nodes = self.viewer.tree(nodes)
        sandboxes = [n for n in nodes if n["kind"] == "sandbox"]
        # one request for the whole tree instead of one per sandbox (the lab panel shows all of them)
        if with_memory:
            await self.call(self._add_memory, sandboxes)
        if with_busy:
            await self._add_busy(sandboxes)
        self.send(nodes)

    def _add_memory(self, sandboxes: list[dict]) -> None:
        for node in sandboxes:
            try:
                node["memory"] = self.controller.memory(node["id"])
            except ForkdError:  # gone since the listing: the event says so
                node["memory"] = None

    async def _add_busy(self, sandboxes: list[dict]) -> None:
        """What each sandbox's main thread runs, from a ping of each, side by side on the probe pool
        (admission.py): each ping has ``BUSY_PING_TIMEOUT``, the whole ``BUSY_DEADLINE``, so frozen
        agents cost probe threads for a second, never a control thread, and show as not answering.
        A look never wakes a sandbox: one frozen or stored since the listing stays so (``wake=False``)."""
        for node in sandboxes:
            if node.get("tier", "running") != "running":
                node["busy"] = None  # a frozen or stored sandbox runs nothing
        sandboxes = [n for n in sandboxes if n.get("tier", "running") == "running"]
        pings = [functools.partial(self.controller.ping, n["id"], timeout=BUSY_PING_TIMEOUT, wake=False)
                 for n in sandboxes]
        for node, got in zip(sandboxes, await self.app.admission.probe(pings, BUSY_DEADLINE)):
            if isinstance(got, dict):
                node["busy"] = got.get("busy")
            elif isinstance(got, NotRunning):
                node["busy"] = None  # moved down since the listing: its tier event says so
            elif got is None:
                node["busy"] = (f"unknown: not pinged within {BUSY_DEADLINE:g} s (the server's pings waited on "
                                f"sandboxes that do not answer)")
            elif isinstance(got, ForkdError) and got.status in (404, 410):
                node["busy"] = None  # gone since the listing: its killed event says so
            else:
                node["busy"] = (f"not answering: no reply to a ping within {BUSY_PING_TIMEOUT:g} s (frozen, or "
                                f"stuck outside Python; POST /v1/sandboxes/{node['id']}/interrupt or DELETE it)")
