"""What the router must not forget across a restart, in SQLite: the host table (with the hosts that
registered themselves) and the pins.

A *pin* says which host holds an object the router answers for: a sandbox (``sandbox``, by id), a
snapshot (``snapshot``, by tag: a VM snapshot may be held by several hosts, so a tag has a pin per
host), a workspace (``workspace``, by name), a forkd kernel's record (``kernel``, by id) or a
notebook's left HEAD (``kernel_left``, by notebook, fleet/left.py). Each pin
keeps the object's last known JSON (``record``), so a sandbox whose host is down can still be
listed, as ``lost``. Writes are a few rows in WAL mode without a sync per commit (a lost commit on
power failure costs only pins the next reconcile finds again), made on the router's event loop.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS hosts (
    url TEXT PRIMARY KEY,
    state TEXT NOT NULL,          -- unknown | up | down
    reason TEXT,                  -- why it is down
    last_ok REAL,                 -- unix time of its last good heartbeat
    capacity TEXT                 -- its last capacity block (JSON) or NULL
);
CREATE TABLE IF NOT EXISTS pins (
    kind TEXT NOT NULL,           -- sandbox | snapshot | workspace | kernel | kernel_left | fork_tree | pending_fork
    key TEXT NOT NULL,            -- id, tag or name
    host TEXT NOT NULL,
    record TEXT,                  -- the object's last known JSON
    pinned_at REAL NOT NULL,
    PRIMARY KEY (kind, key, host)
);
CREATE INDEX IF NOT EXISTS pins_by_host ON pins(host, kind);
CREATE TABLE IF NOT EXISTS registered (
    url TEXT PRIMARY KEY,         -- a host that registered itself (forkd serve --register)
    announced_at REAL NOT NULL    -- unix time of its last announcement
);
"""


class State:
    """The router's SQLite file (``router.db`` in its data dir)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=5000")  # a second router on the same file waits its turn
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # --- hosts ------------------------------------------------------------------------------------

    def hosts(self) -> dict[str, dict]:
        rows = self.db.execute("SELECT url, state, reason, last_ok, capacity FROM hosts").fetchall()
        return {url: {"state": state, "reason": reason, "last_ok": last_ok,
                      "capacity": json.loads(capacity) if capacity else None}
                for url, state, reason, last_ok, capacity in rows}

    def save_host(self, url: str, state: str, reason: str | None, last_ok: float | None,
                  capacity: dict | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO hosts(url, state, reason, last_ok, capacity) VALUES (?,?,?,?,?)",
                        (url, state, reason, last_ok, json.dumps(capacity) if capacity is not None else None))

    def registered(self) -> dict[str, float]:
        """url -> last announcement of every host that registered itself."""
        return dict(self.db.execute("SELECT url, announced_at FROM registered").fetchall())

    def save_registration(self, url: str, announced_at: float) -> None:
        self.db.execute("INSERT INTO registered(url, announced_at) VALUES (?,?) ON CONFLICT(url) DO UPDATE SET "
                        "announced_at=max(announced_at, excluded.announced_at)", (url, announced_at))

    # --- pins -------------------------------------------------------------------------------------

    def pin(self, kind: str, items: list[tuple[str, dict | None]], host: str, *, exclusive: bool = True) -> None:
        """Pin each (key, record) to ``host``; ``exclusive``: the key lives on that host only (a
        sandbox, a workspace, a kernel), so any pin of it elsewhere goes."""
        now = time.time()
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            for key, record in items:
                if exclusive:
                    self.db.execute("DELETE FROM pins WHERE kind=? AND key=? AND host<>?", (kind, key, host))
                self.db.execute("INSERT OR REPLACE INTO pins(kind, key, host, record, pinned_at) VALUES (?,?,?,?,?)",
                                (kind, key, host, json.dumps(record) if record is not None else None, now))

    def claim(self, kind: str, items: list[tuple[str, dict | None]], host: str) -> list[str]:
        """Pin each (key, record) to ``host`` unless another host holds a pin of the key; returns the
        keys another host holds (not pinned). One transaction: two routers on this file that both
        see an id free cannot both take it (the second sees the first's pin)."""
        now, taken = time.time(), []
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            for key, record in items:
                if self.db.execute("SELECT 1 FROM pins WHERE kind=? AND key=? AND host<>?", (kind, key, host)).fetchone():
                    taken.append(key)
                    continue
                self.db.execute("INSERT OR REPLACE INTO pins(kind, key, host, record, pinned_at) VALUES (?,?,?,?,?)",
                                (kind, key, host, json.dumps(record) if record is not None else None, now))
        return taken

    def unpin(self, kind: str, key: str, host: str | None = None) -> None:
        if host is None:
            self.db.execute("DELETE FROM pins WHERE kind=? AND key=?", (kind, key))
        else:
            self.db.execute("DELETE FROM pins WHERE kind=? AND key=? AND host=?", (kind, key, host))

    def take(self, kind: str, key: str) -> tuple[str, dict | None] | None:
        """Unpin ``key`` and return (host, record) of its first pin, or None: one transaction, so of
        two routers on this file only one takes it."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            row = self.db.execute("SELECT host, record FROM pins WHERE kind=? AND key=? ORDER BY pinned_at LIMIT 1",
                                  (kind, key)).fetchone()
            if row is not None:
                self.db.execute("DELETE FROM pins WHERE kind=? AND key=?", (kind, key))
        return (row[0], json.loads(row[1]) if row[1] else None) if row is not None else None

    def hosts_of(self, kind: str, key: str) -> list[str]:
        rows = self.db.execute("SELECT host FROM pins WHERE kind=? AND key=? ORDER BY pinned_at", (kind, key))
        return [r[0] for r in rows]

    def host_of(self, kind: str, key: str) -> str | None:
        hosts = self.hosts_of(kind, key)
        return hosts[0] if hosts else None

    def record(self, kind: str, key: str) -> dict | None:
        """The record kept with the first pin of ``key`` (None: no pin, or one without a record)."""
        row = self.db.execute("SELECT record FROM pins WHERE kind=? AND key=? ORDER BY pinned_at LIMIT 1",
                              (kind, key)).fetchone()
        return json.loads(row[0]) if row and row[0] else None

    def records(self, kind: str) -> dict[str, dict | None]:
        """key -> record of every pin of ``kind`` (the first pin's, for a key pinned to several hosts)."""
        rows = self.db.execute("SELECT key, record FROM pins WHERE kind=? ORDER BY pinned_at DESC", (kind,))
        return {key: json.loads(record) if record else None for key, record in rows}

    def pinned_on(self, host: str, kind: str) -> dict[str, dict | None]:
        """key -> last known record of every ``kind`` pinned to ``host``."""
        rows = self.db.execute("SELECT key, record FROM pins WHERE host=? AND kind=?", (host, kind))
        return {key: json.loads(record) if record else None for key, record in rows}

    def replace_host_pins(self, host: str, kind: str, items: dict[str, dict], listed_at: float) -> tuple[set[str], set[str]]:
        """Make ``host``'s pins of ``kind`` what it listed at ``listed_at`` (``items``); returns (keys
        added, keys dropped). A pin made since ``listed_at`` stays: the listing predates it."""
        rows = self.db.execute("SELECT key, pinned_at FROM pins WHERE host=? AND kind=?", (host, kind)).fetchall()
        before = {key for key, _ in rows}
        added = set(items) - before
        dropped = {key for key, at in rows if key not in items and at < listed_at}
        now = time.time()
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            for key in dropped:
                self.db.execute("DELETE FROM pins WHERE kind=? AND key=? AND host=? AND pinned_at<?",
                                (kind, key, host, listed_at))
            for key in added:
                self.db.execute("INSERT OR REPLACE INTO pins(kind, key, host, record, pinned_at) VALUES (?,?,?,?,?)",
                                (kind, key, host, json.dumps(items[key]), now))
        return added, dropped
