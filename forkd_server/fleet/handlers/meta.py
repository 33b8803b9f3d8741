"""Meta routes and the merged views: health, version, the host table, metrics, the OpenAPI document,
events and the tree."""

from __future__ import annotations

import json
import os
from urllib.parse import parse_qsl


from ... import __version__
from ...hub.ownership import holders_labels
from ..hosts import Host
from ...sse import EventStream
from ..router import Router
from .base import RouterHandler, host_query

OPENAPI_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "openapi.json")


class HealthHandler(RouterHandler):
    public = True

    def get(self) -> None:
        hosts = self.router.hosts.values()
        self.send({"ok": True, "router": True, "hosts": len(hosts), "hosts_up": sum(h.up for h in hosts)})


class VersionHandler(RouterHandler):
    for_users = True

    def get(self) -> None:
        self.send({"version": __version__, "api": "v1", "router": True})


class HostsHandler(RouterHandler):
    """``GET /v1/fleet/hosts``: the host table (state, why a host is down, its capacity)."""

    admin_only = "the host table names every host and counts every user's sandboxes"

    def get(self) -> None:
        self.send(self.router.hosts_json())


class MetricsHandler(RouterHandler):
    auth_resource = "forkd:metrics"  # admins only under JupyterHub (hub/authorizer.py says why)

    def get(self) -> None:
        hosts = list(self.router.hosts.values())
        lines = ["# HELP forkd_fleet_hosts Hosts of the fleet by state.", "# TYPE forkd_fleet_hosts gauge"]
        for state in ("up", "down", "unknown"):
            lines.append(f'forkd_fleet_hosts{{state="{state}"}} {sum(h.state == state for h in hosts)}')
        lines += ["# HELP forkd_fleet_host_up Whether a host is up (1) or not (0).", "# TYPE forkd_fleet_host_up gauge"]
        lines += [f'forkd_fleet_host_up{{host="{h.url}"}} {int(h.up)}' for h in hosts]
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish("\n".join(lines) + "\n")


class OpenAPIHandler(RouterHandler):
    for_users = True

    def get(self) -> None:
        with open(OPENAPI_PATH) as f:
            doc = json.load(f)
        doc["servers"] = [{"url": "/"}]
        self.send(doc)


class EventsHandler(EventStream, RouterHandler):
    """Every host's events in one stream, each with its ``host``, and the router's own; under
    JupyterHub only those about what the caller sees (hub.py)."""

    for_users = True

    async def get(self) -> None:
        viewer, hub = self.viewer, self.hub
        await self.stream_events(self.router.events, "forkd fleet events", self.sse_keepalive,
                                 visible=None if viewer is None else lambda event: hub.event_visible(viewer, event))


def labels_match(record: dict, query: str) -> bool:
    wanted = [v.split("=", 1) for k, v in parse_qsl(query) if k == "label" and "=" in v]
    labels = record.get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted)


def merge_snapshots(parts: list[tuple[Host, list]]) -> list[dict]:
    """One entry per tag: the first host's, with ``host`` and every holder in ``hosts``, and the
    server's labels of every holder (``holders_labels``)."""
    out: dict[str, dict] = {}
    for host, items in parts:
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("tag", item.get("id")), str):
                continue
            key = item.get("tag", item.get("id"))
            if key in out:
                out[key]["hosts"].append(host.url)
                out[key]["labels"] = holders_labels([out[key], item])
            else:
                out[key] = {**item, "host": host.url, "hosts": [host.url]}
    return list(out.values())


def lost_snapshots(router: Router, held: set[str], query: str) -> list[dict]:
    """Snapshots known only on hosts that are down (one entry per tag), unless an up host holds them."""
    out: dict[str, dict] = {}
    for rec in router.lost_records("snapshot"):
        if rec["tag"] not in held and labels_match(rec, query):
            out.setdefault(rec["tag"], {**rec, "hosts": [rec["host"]]})
    return list(out.values())


class TreeHandler(RouterHandler):
    """Every host's tree as one: a ``host`` on every node; a snapshot several hosts hold is one node
    (``hosts`` lists them); sandboxes of a host that is down are nodes with status ``lost``."""

    for_users = True

    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/tree" + host_query(self))
        snapshots = merge_snapshots([(h, [n for n in nodes if isinstance(n, dict) and n.get("kind") == "snapshot"])
                                     for h, nodes in parts])
        held = {n["id"] for n in snapshots}
        snapshots += [{"id": r["tag"], "kind": "snapshot", "parent": None, "status": "lost", "pause_ms": None,
                       "pause_us": None, "created_at": None, "engine": r.get("engine"), "lineage": [r["tag"]],
                       "labels": r.get("labels") or {}, "host": r["host"], "hosts": [r["host"]], "lost": r["lost"]}
                      for r in lost_snapshots(self.router, held, self.request.query)]
        sandboxes = [{**n, "host": h.url} for h, nodes in parts for n in nodes
                     if isinstance(n, dict) and n.get("kind") != "snapshot"]
        for rec in self.router.lost_records("sandbox"):
            if not labels_match(rec, self.request.query):
                continue
            lineage = rec.get("lineage") or [rec.get("snapshot_tag"), rec["id"]]
            sandboxes.append({"id": rec["id"], "kind": "sandbox", "parent": lineage[-2] if len(lineage) > 1 else None,
                              "status": "lost", "pause_ms": None, "pause_us": None,
                              "created_at": rec.get("created_at_unix"), "engine": rec.get("engine"),
                              "lineage": lineage, "labels": rec.get("labels") or {}, "host": rec["host"],
                              "lost": rec["lost"]})
        self.send(self.seen("node", snapshots + sandboxes), missing=missing)
