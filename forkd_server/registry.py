"""The crash-safe record of every snapshot and sandbox: SQLite in WAL mode.

Each change is one transaction with ``synchronous=FULL``, so a ``kill -9`` of the server (or a power
cut) leaves either the old or the new record, never half of one. Engine handles are stored as JSON
so a restarted controller can re-attach to live templates and sandboxes.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3

import orjson
import threading
from typing import Iterator

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    tag TEXT PRIMARY KEY,
    engine TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('writing', 'ready', 'failed')),
    created_at REAL NOT NULL,
    branched_from TEXT,
    pause_ms REAL,
    prepare_ms REAL,
    lineage TEXT NOT NULL,
    spec TEXT NOT NULL,
    handle TEXT,
    warning TEXT
);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    snapshot_tag TEXT NOT NULL,
    engine TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('starting', 'running')),
    created_at REAL NOT NULL,
    lineage TEXT NOT NULL,
    memory_limit_mib INTEGER,
    branch_count INTEGER NOT NULL DEFAULT 0,
    handle TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_JSON = {"lineage", "spec", "handle"}


def _decode(row: sqlite3.Row | None) -> dict | None:
    if row is None:
        return None
    out = dict(row)
    for key in _JSON & out.keys():
        if out[key] is not None:
            out[key] = orjson.loads(out[key])
    return out


def _encode(fields: dict) -> dict:
    return {k: (json.dumps(v) if k in _JSON and v is not None else v) for k, v in fields.items()}


class Registry:
    def __init__(self, path: str):
        self._lock = threading.RLock()
        # Decoded rows of whole tables, reused until a commit: ours clears it, another connection's
        # (another process sharing the data dir) shows in PRAGMA data_version. Rows are read-only.
        self._tables: dict[str, tuple[int, list[dict]]] = {}  # table -> (generation, rows)
        self._generation = 0
        self._version = None
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One atomic change: BEGIN IMMEDIATE ... COMMIT, rolled back on any error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self._tables.clear()

    def next_counter(self, name: str, count: int = 1) -> int:
        """Reserve ``count`` values of a persistent counter; returns the first."""
        with self.tx() as db:
            row = db.execute("SELECT value FROM counters WHERE name=?", (name,)).fetchone()
            first = row[0] if row else 0
            db.execute("INSERT OR REPLACE INTO counters(name, value) VALUES (?, ?)", (name, first + count))
        return first

    # --- generic row helpers ----------------------------------------------------------------------

    def _insert(self, table: str, rows: list[dict]) -> None:
        with self.tx() as db:
            for row in rows:
                enc = _encode(row)
                cols = ", ".join(enc)
                marks = ", ".join("?" for _ in enc)
                db.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", tuple(enc.values()))

    def _update(self, table: str, key: str, value: str, fields: dict) -> None:
        enc = _encode(fields)
        sets = ", ".join(f"{k}=?" for k in enc)
        with self.tx() as db:
            db.execute(f"UPDATE {table} SET {sets} WHERE {key}=?", (*enc.values(), value))

    def _get(self, table: str, key: str, value: str) -> dict | None:
        with self._lock:
            return _decode(self._db.execute(f"SELECT * FROM {table} WHERE {key}=?", (value,)).fetchone())

    def _table(self, table: str, order: str) -> tuple[int, list[dict]]:
        """The decoded table, shared and read-only, with a generation number that changes whenever
        the table may have changed: callers can cache what they derive from it."""
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version != self._version:
                self._tables.clear()
                self._version = version
            entry = self._tables.get(table)
            if entry is None:
                self._generation += 1
                rows = [_decode(r) for r in self._db.execute(f"SELECT * FROM {table} ORDER BY {order}")]
                entry = self._tables[table] = (self._generation, rows)
            return entry

    def _all(self, table: str, order: str) -> list[dict]:
        return [dict(r) for r in self._table(table, order)[1]]

    # --- snapshots --------------------------------------------------------------------------------

    def insert_snapshot(self, row: dict) -> None:
        self._insert("snapshots", [row])

    def update_snapshot(self, tag: str, **fields) -> None:
        self._update("snapshots", "tag", tag, fields)

    def get_snapshot(self, tag: str) -> dict | None:
        return self._get("snapshots", "tag", tag)

    def list_snapshots(self) -> list[dict]:
        return self._all("snapshots", "tag")

    def delete_snapshot(self, tag: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM snapshots WHERE tag=?", (tag,))

    # --- sandboxes --------------------------------------------------------------------------------

    def insert_sandboxes(self, rows: list[dict]) -> None:
        self._insert("sandboxes", rows)

    def update_sandbox(self, sandbox_id: str, **fields) -> None:
        self._update("sandboxes", "id", sandbox_id, fields)

    def set_sandbox_handles(self, handles: dict[str, dict]) -> None:
        """Mark many sandboxes running in one transaction."""
        with self.tx() as db:
            for sid, handle in handles.items():
                db.execute("UPDATE sandboxes SET status='running', handle=? WHERE id=?",
                           (json.dumps(handle), sid))

    def get_sandbox(self, sandbox_id: str) -> dict | None:
        return self._get("sandboxes", "id", sandbox_id)

    def list_sandboxes(self) -> list[dict]:
        return self._all("sandboxes", "id")

    def sandbox_table(self) -> tuple[int, list[dict]]:
        """(generation, rows) of the sandboxes table; the rows must not be modified."""
        return self._table("sandboxes", "id")

    def delete_sandboxes(self, ids: list[str]) -> None:
        with self.tx() as db:
            db.executemany("DELETE FROM sandboxes WHERE id=?", [(i,) for i in ids])

    def bump_branch_count(self, sandbox_id: str) -> int:
        """Increment a sandbox's branch counter; returns the value before (the branch's seq)."""
        with self.tx() as db:
            row = db.execute("SELECT branch_count FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
            if row is None:
                return 0
            db.execute("UPDATE sandboxes SET branch_count=? WHERE id=?", (row[0] + 1, sandbox_id))
            return row[0]
