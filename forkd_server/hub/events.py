"""Which changes a Hub user's ``/v1/events`` stream carries: those of what they see.

An event names its object (a sandbox's id, a snapshot's tag, a kernel's id), and a deletion's
object is gone from the registry by the time the stream sends it. So the labels of each object are
read when a change happens (in the thread making it, before the stream sees the event), kept, and
looked up when the event is sent: a sandbox's end reaches its owner. Objects of a previous run are
read once at start.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .ownership import Caller

KEPT = 100_000  # objects whose labels are remembered, the latest changed first


def event_key(event: dict) -> tuple[str, str] | None:
    """The object an event is about: (kind, its id, tag or name), or None."""
    kind = event.get("kind")
    name = {"sandbox": "id", "snapshot": "tag", "kernel": "kernel_id", "workspace": "name"}.get(kind)
    return (kind, event[name]) if name and isinstance(event.get(name), str) else None


class KeptLabels:
    """The labels of the latest ``KEPT`` objects, by (kind, key): what an event's visibility is
    decided by once its object may be gone (a server's, or a router's for the whole fleet)."""

    def __init__(self):
        self._labels: OrderedDict[tuple[str, str], dict] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, key: tuple[str, str], labels: dict) -> None:
        with self._lock:
            self._labels[key] = labels
            self._labels.move_to_end(key)
            while len(self._labels) > KEPT:
                self._labels.popitem(last=False)

    def get(self, key: tuple[str, str] | None) -> dict | None:
        return self._labels.get(key) if key is not None else None

    def visible(self, caller: Caller, event: dict) -> bool:
        """May ``caller`` see this event? Objects whose labels are not known are not shown."""
        if caller.admin:
            return True
        key = event_key(event)
        labels = self.get(key)
        return labels is not None and caller.sees(labels, snapshot=key[0] == "snapshot")


class EventOwners:
    def __init__(self, controller):
        self.registry = controller.registry
        self.kept = KeptLabels()
        for row in self.registry.list_snapshots():
            self.kept.keep(("snapshot", row["tag"]), row.get("labels") or {})
        for row in self.registry.list_sandboxes():
            self.kept.keep(("sandbox", row["id"]), row.get("labels") or {})
        for row in self.registry.list_workspaces():
            self.kept.keep(("workspace", row["name"]), row.get("labels") or {})

    def record(self, event: dict) -> None:
        """The controller's listener: note the labels of the object this change is about."""
        key = event_key(event)
        if key is None:
            return
        kind, name = key
        if kind == "kernel":  # a kernel is its HEAD's: seen by whoever sees that sandbox
            if event.get("action") != "head":
                return
            labels = self.kept.get(("sandbox", event.get("head")))
            row = None if labels is not None else self.registry.get_sandbox(event.get("head") or "")
            labels = labels if labels is not None else (row or {}).get("labels")
        else:
            row = {"sandbox": self.registry.get_sandbox, "snapshot": self.registry.get_snapshot,
                   "workspace": self.registry.get_workspace}[kind](name)
            labels = None if row is None else row.get("labels") or {}
        if labels is not None:
            self.kept.keep(key, labels)

    def visible(self, caller: Caller, event: dict) -> bool:
        return self.kept.visible(caller, event)
