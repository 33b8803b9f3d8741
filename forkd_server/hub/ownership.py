"""Who owns what, on the wire objects themselves: one rule for ``forkd serve`` and a router alike.

Everything a Hub user makes (a sandbox, a snapshot: created, branched, compacted) carries the
label ``forkd.owner`` with the user's name, set by the server from the authenticated user. Labels
under ``forkd.`` are the server's: a user who sends one is refused (403), and they are never
inherited (a sandbox of a shared snapshot is its spawner's, not the snapshot's owner's, and is not
shared). An admin marks a snapshot shared (``forkd.shared=true``, ``POST /v1/snapshots/{tag}/share``):
every user may list it and spawn from it; only admins may change or delete it.

A user sees only their own objects and shared snapshots; anything else answers 404, as an unknown
id does, so ids do not leak. An admin (a Hub admin, or the server's own token) sees everything.
This module only decides; the handlers (``handlers/base.py``) ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

OWNER = "forkd.owner"
SHARED = "forkd.shared"
RESERVED_PREFIX = "forkd."


def server_label(key: str) -> bool:
    """A label only the server sets (and that no child or branch inherits)."""
    return key.startswith(RESERVED_PREFIX)


def inheritable(labels: dict | None) -> dict:
    """The labels a child or branch takes from its parent: all but the server's."""
    return {k: v for k, v in (labels or {}).items() if not server_label(k)}


def holders_labels(entries: list[dict]) -> dict:
    """The labels of a snapshot several hosts hold: the first holder's, plus the server's labels
    (``forkd.owner``, ``forkd.shared``) another holder has and it lacks: a copy pulled from the
    store carries no labels, yet it is the same snapshot, with the same owner."""
    labels = dict(entries[0].get("labels") or {}) if entries else {}
    for entry in entries[1:]:
        for k, v in (entry.get("labels") or {}).items():
            if server_label(k):
                labels.setdefault(k, v)
    return labels


class Refused(Exception):
    """A request the caller may not make; ``status`` 403 (or 404 where existence must not leak)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Caller:
    """The Hub user (or service) a request acts for."""

    name: str
    admin: bool = False

    def sees(self, labels: dict | None, *, snapshot: bool = False) -> bool:
        """May this caller see (and spawn from, when a snapshot) an object with these labels?"""
        labels = labels or {}
        return self.admin or labels.get(OWNER) == self.name or (snapshot and labels.get(SHARED) == "true")

    def may_change(self, labels: dict | None) -> bool:
        """May this caller change or delete it? Its owner and admins; a shared snapshot only admins."""
        labels = labels or {}
        return self.admin or (labels.get(OWNER) == self.name and labels.get(SHARED) != "true")

    def check(self, kind: str, key: str, labels: dict | None, *, change: bool = False) -> None:
        """Refused unless this caller sees the ``kind`` ``key`` whose labels are ``labels`` (None:
        there is none): 404 as for an unknown one, so ids do not leak; with ``change``, 403 when they
        see it but may not change it (a shared snapshot)."""
        if labels is None or not self.sees(labels, snapshot=kind == "snapshot"):
            raise Refused(404, f"{kind} {key} not found")
        if change and not self.may_change(labels):
            raise Refused(403, f"{kind} {key} is shared by an admin: every user may spawn from it, only admins "
                               f"may change or delete it")

    def stamp(self, labels: dict | None) -> dict:
        """The labels of something this caller makes: theirs, with the owner set by the server.
        A non-admin who sends a server label is refused; an admin may set ``forkd.shared``."""
        labels = dict(labels or {})
        self.check_labels(labels)
        if OWNER in labels and labels[OWNER] != self.name:
            raise Refused(403, f"label {OWNER} is set by the server to the caller ({self.name}); send the request "
                               f"without it")
        labels[OWNER] = self.name
        return labels

    def check_labels(self, labels: dict | None) -> None:
        """Labels a non-admin sends: none of the server's, but their own name as owner (what the
        server sets anyway, so that a client copying an object's labels is not refused)."""
        sent = sorted(k for k, v in (labels or {}).items() if server_label(k) and not (k == OWNER and v == self.name))
        if sent and not self.admin:
            raise Refused(403, f"label {sent[0]} is set by the server (labels under {RESERVED_PREFIX} are the "
                               f"server's: {OWNER} names who made an object, {SHARED} is set by an admin); "
                               f"send the request without it")

    # --- whole listings --------------------------------------------------------------------------

    def sandboxes(self, infos: list[dict]) -> list[dict]:
        return infos if self.admin else [i for i in infos if self.sees(i.get("labels"))]

    def snapshots(self, infos: list[dict]) -> list[dict]:
        return infos if self.admin else [i for i in infos if self.sees(i.get("labels"), snapshot=True)]

    def tree(self, nodes: list[dict]) -> list[dict]:
        """The caller's nodes and the shared snapshots; a node whose parent is hidden keeps its
        ``lineage`` (names of what it came from) and draws as a root of the caller's tree."""
        if self.admin:
            return nodes
        return [n for n in nodes if self.sees(n.get("labels"), snapshot=n.get("kind") == "snapshot")]
