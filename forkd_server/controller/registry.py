"""The crash-safe record of every snapshot, sandbox and workspace: SQLite in WAL mode.

Each change is one transaction with ``synchronous=FULL``, so a ``kill -9`` of the server (or a power
cut) leaves either the old or the new record, never half of one. A spawn's two transactions, and a
branch's and fork's where the engine's snapshots are processes too, are the exception
(``tx(durable=False)``): they record processes, which a power cut or a crash of the host ends too,
so they are committed without waiting for the disk (a ``kill -9`` of the server still
loses nothing of them: the operating system holds the write; the next durable commit, or a
checkpoint, puts them on disk). A host that went down within that moment may come back without
the rows of its last spawn or fork, whose processes died with it; each engine's recovery removes
what no row names. Engine handles are stored as JSON
so a restarted controller can re-attach to live templates and sandboxes.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import time

import orjson
import threading
from typing import Iterator

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    tag TEXT PRIMARY KEY,
    engine TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('writing', 'ready', 'failed', 'lost')),
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
CREATE TABLE IF NOT EXISTS ended_sandboxes (
    id TEXT PRIMARY KEY,
    snapshot_tag TEXT NOT NULL,
    ended_at REAL NOT NULL,
    reason TEXT NOT NULL,
    limit_hit TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS workspaces (
    name TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    source_snapshot_tag TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('running', 'suspended', 'stale')),
    live_sandbox_id TEXT,
    current_state_tag TEXT,
    memory_limit_mib INTEGER,
    created_at REAL NOT NULL,
    last_active REAL NOT NULL,
    last_branch_memory_path TEXT,
    retiring TEXT
);
"""
# Tables and columns are only ever added, so a registry written by an older version opens and
# gains the new tables empty and the new columns NULL (which every reader takes as "none").
_ADDED_COLUMNS = {
    "snapshots": {"warnings": "TEXT",  # JSON list: what a lossy fork left behind
                  "labels": "TEXT"},   # JSON object str -> str
    "sandboxes": {"labels": "TEXT",
                  "ending": "TEXT",    # JSON: why it is being ended; the row goes once its process has
                  "tier": "TEXT",      # "frozen" | "stored"; NULL: running (tiers.py)
                  "stored": "TEXT"},   # JSON: a stored sandbox's state snapshot {"handle", "digest", "remote"}
    "workspaces": {"labels": "TEXT"},  # JSON object: its owner's (hub/), given to its sandboxes and state
    "ended_sandboxes": {"hint": "TEXT",      # what to do, one line (endings.py)
                        "details": "TEXT",   # JSON object: the facts behind the reason
                        "labels": "TEXT"},   # the sandbox's, so its end is told to its owner only (hub/)
}
ENDED_KEPT = 1000  # sandboxes whose end (when, why) is remembered, the latest first
_JSON = {"lineage", "spec", "handle", "retiring", "warnings", "labels", "details", "ending", "stored"}


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
        # Decoded rows, reused until a commit: ours clears them, another connection's (another
        # process sharing the data dir) shows in PRAGMA data_version. Rows are read-only.
        self._tables: dict[str, tuple[int, list[dict]]] = {}  # table -> (generation, rows)
        self._sandbox_rows: dict[str, dict] = {}  # id -> row, read one by one (shared_sandbox)
        self._generation = 0
        self._version = None
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._allow_lost()
        for table, columns in _ADDED_COLUMNS.items():
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def _allow_lost(self) -> None:
        """A registry made before snapshots could be ``lost`` checks status against the three older
        values; SQLite cannot change a CHECK in place, so the table is rebuilt, in one transaction."""
        sql = self._db.execute("SELECT sql FROM sqlite_master WHERE type='table' AND name='snapshots'").fetchone()[0]
        if "'lost'" in sql:
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("ALTER TABLE snapshots RENAME TO snapshots_before_lost")
            self._db.execute(sql.replace("'failed')", "'failed', 'lost')"))
            self._db.execute("INSERT INTO snapshots SELECT * FROM snapshots_before_lost")
            self._db.execute("DROP TABLE snapshots_before_lost")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def tx(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One atomic change: BEGIN IMMEDIATE ... COMMIT, rolled back on any error. ``durable=False``
        commits without the fsync (``synchronous=NORMAL`` in WAL mode: still atomic, and kept
        through a crash of this process, not of the host): for rows that die with the host anyway."""
        with self._lock:
            if not durable:
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                self._forget_rows()  # committed, or rolled back after rows were read inside it
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    def next_counter(self, name: str, count: int = 1) -> int:
        """Reserve ``count`` values of a persistent counter; returns the first."""
        with self.tx() as db:
            return self._next(db, name, count)

    @staticmethod
    def _next(db: sqlite3.Connection, name: str, count: int, start: int = 0) -> int:
        """The counter's next ``count`` values (a new counter begins at ``start``)."""
        row = db.execute("SELECT value FROM counters WHERE name=?", (name,)).fetchone()
        first = row[0] if row else start
        db.execute("INSERT OR REPLACE INTO counters(name, value) VALUES (?, ?)", (name, first + count))
        return first

    # --- generic row helpers ----------------------------------------------------------------------

    def _insert(self, table: str, rows: list[dict], durable: bool = True) -> None:
        with self.tx(durable) as db:
            self._insert_rows(db, table, rows)

    @staticmethod
    def _insert_rows(db: sqlite3.Connection, table: str, rows: list[dict]) -> None:
        for row in rows:
            enc = _encode(row)
            cols = ", ".join(enc)
            marks = ", ".join("?" for _ in enc)
            db.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", tuple(enc.values()))

    def _update(self, table: str, key: str, value: str, fields: dict, durable: bool = True) -> None:
        enc = _encode(fields)
        sets = ", ".join(f"{k}=?" for k in enc)
        with self.tx(durable) as db:
            db.execute(f"UPDATE {table} SET {sets} WHERE {key}=?", (*enc.values(), value))

    def _get(self, table: str, key: str, value: str, block: bool = True) -> dict | None:
        if not self._lock.acquire(blocking=block):
            raise BlockingIOError("the registry is held by another thread (a commit)")
        try:
            return _decode(self._db.execute(f"SELECT * FROM {table} WHERE {key}=?", (value,)).fetchone())
        finally:
            self._lock.release()

    def _forget_rows(self) -> None:
        """Every decoded row kept is dropped: a commit may have changed any of them."""
        self._tables.clear()
        self._sandbox_rows.clear()

    def _see_other_commits(self) -> None:
        """(Holding the lock.) Drop the decoded rows if another connection committed since the
        last look."""
        version = self._db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._version:
            self._forget_rows()
            self._version = version

    def _table(self, table: str, order: str) -> tuple[int, list[dict]]:
        """The decoded table, shared and read-only, with a generation number that changes whenever
        the table may have changed: callers can cache what they derive from it."""
        with self._lock:
            self._see_other_commits()
            entry = self._tables.get(table)
            if entry is None:
                self._generation += 1
                rows = [_decode(r) for r in self._db.execute(f"SELECT * FROM {table} ORDER BY {order}")]
                entry = self._tables[table] = (self._generation, rows)
            return entry

    def _all(self, table: str, order: str) -> list[dict]:
        return [dict(r) for r in self._table(table, order)[1]]

    # --- snapshots --------------------------------------------------------------------------------

    def insert_snapshot(self, row: dict, *, durable: bool = True) -> None:
        self._insert("snapshots", [row], durable)

    def update_snapshot(self, tag: str, *, durable: bool = True, **fields) -> None:
        self._update("snapshots", "tag", tag, fields, durable)

    def get_snapshot(self, tag: str) -> dict | None:
        return self._get("snapshots", "tag", tag)

    def list_snapshots(self) -> list[dict]:
        return self._all("snapshots", "tag")

    def count_snapshots(self, status: str) -> int:
        """How many snapshots have ``status``, from the cached table (no query while it is unchanged)."""
        return sum(1 for r in self._table("snapshots", "tag")[1] if r["status"] == status)

    def delete_snapshot(self, tag: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM snapshots WHERE tag=?", (tag,))

    # --- sandboxes --------------------------------------------------------------------------------

    def insert_sandboxes(self, rows: list[dict]) -> None:
        self._insert("sandboxes", rows)

    def insert_numbered_sandboxes(self, count: int, rows_from) -> list[dict]:
        """Reserve ``count`` sandbox numbers and insert the rows ``rows_from(first number)`` makes
        of them, in one transaction (a spawn's first of two, not waiting for the disk: see above);
        returns the rows. A new data dir's numbers begin at random: ids are
        ``sb-<second>-<number mod 2**16>``, and hosts behind one router that all began at 0 handed
        out the same ids when a spawn split over them, which the router must kill and spawn again
        (a second, serial spawn of that part)."""
        with self.tx(durable=False) as db:
            rows = rows_from(self._next(db, "sandbox", count, start=secrets.randbelow(0x10000)))
            self._insert_rows(db, "sandboxes", rows)
        return rows

    def update_sandbox(self, sandbox_id: str, *, durable: bool = True, **fields) -> None:
        self._update("sandboxes", "id", sandbox_id, fields, durable)

    def set_sandbox_handles(self, handles: dict[str, dict]) -> None:
        """Mark many sandboxes running in one transaction (a spawn's second, not waiting for the
        disk: see above)."""
        with self.tx(durable=False) as db:
            for sid, handle in handles.items():
                db.execute("UPDATE sandboxes SET status='running', handle=? WHERE id=?",
                           (json.dumps(handle), sid))

    def get_sandbox(self, sandbox_id: str, block: bool = True) -> dict | None:
        """The sandbox's row; ``block=False`` (the event loop): ``BlockingIOError`` rather than
        waiting for another thread's use of the registry (a commit may wait for the disk)."""
        return self._get("sandboxes", "id", sandbox_id, block)

    def shared_sandbox(self, sandbox_id: str) -> dict | None:
        """``get_sandbox(sandbox_id, block=False)`` for the event loop's pings, whose every call
        reads its row: the row is decoded once and shared until a commit changes the registry (one
        of ours, or another process's, seen in ``PRAGMA data_version``, a third of a read's cost).
        It is the registry's row as it is now; callers must not modify it."""
        if not self._lock.acquire(blocking=False):
            raise BlockingIOError("the registry is held by another thread (a commit)")
        try:
            self._see_other_commits()
            row = self._sandbox_rows.get(sandbox_id)
            if row is None:
                row = self._get("sandboxes", "id", sandbox_id, block=False)  # the lock is ours already
                if row is not None:
                    self._sandbox_rows[sandbox_id] = row
            return row
        finally:
            self._lock.release()

    def list_sandboxes(self) -> list[dict]:
        return self._all("sandboxes", "id")

    def sandbox_table(self) -> tuple[int, list[dict]]:
        """(generation, rows) of the sandboxes table; the rows must not be modified."""
        return self._table("sandboxes", "id")

    def delete_sandboxes(self, ids: list[str], ended: dict | None = None) -> None:
        """Drop sandboxes; with ``ended`` (``{"reason", "limit_hit", "hint", "details"}``), in the same transaction,
        remember why they ended (``ended_sandbox``), for the last ``ENDED_KEPT`` sandboxes."""
        with self.tx() as db:
            if ended is not None:
                now = time.time()
                for i in ids:
                    row = db.execute("SELECT snapshot_tag, labels FROM sandboxes WHERE id=?", (i,)).fetchone()
                    if row is not None:
                        db.execute("INSERT OR REPLACE INTO ended_sandboxes (id, snapshot_tag, ended_at, reason, "
                                   "limit_hit, hint, details, labels) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                   (i, row[0], now, ended["reason"], ended.get("limit_hit"), ended.get("hint"),
                                    json.dumps(ended["details"]) if ended.get("details") else None, row[1]))
                db.execute("DELETE FROM ended_sandboxes WHERE id IN (SELECT id FROM ended_sandboxes "
                           "ORDER BY ended_at DESC LIMIT -1 OFFSET ?)", (ENDED_KEPT,))
            db.executemany("DELETE FROM sandboxes WHERE id=?", [(i,) for i in ids])

    def ended_sandbox(self, sandbox_id: str) -> dict | None:
        """Why a sandbox that is no more ended: ``{"id", "snapshot_tag", "ended_at", "reason",
        "limit_hit", "hint", "details", "labels"}``, or None (never known, or forgotten)."""
        return self._get("ended_sandboxes", "id", sandbox_id)

    def bump_branch_count(self, sandbox_id: str) -> int:
        """Increment a sandbox's branch counter; returns the value before (the branch's seq)."""
        with self.tx() as db:
            row = db.execute("SELECT branch_count FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
            if row is None:
                return 0
            db.execute("UPDATE sandboxes SET branch_count=? WHERE id=?", (row[0] + 1, sandbox_id))
            return row[0]

    # --- workspaces -------------------------------------------------------------------------------

    def insert_workspace(self, row: dict) -> None:
        self._insert("workspaces", [row])

    def update_workspace(self, name: str, **fields) -> None:
        self._update("workspaces", "name", name, fields)

    def get_workspace(self, name: str) -> dict | None:
        return self._get("workspaces", "name", name)

    def list_workspaces(self) -> list[dict]:
        return self._all("workspaces", "name")

    def delete_workspace(self, name: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM workspaces WHERE name=?", (name,))

    def mark_workspace_stale(self, name: str, sandbox_id: str) -> bool:
        """running -> stale, only if it still runs ``sandbox_id``; True if this call changed it."""
        with self.tx() as db:
            cur = db.execute("UPDATE workspaces SET status='stale', live_sandbox_id=NULL "
                             "WHERE name=? AND status='running' AND live_sandbox_id=?", (name, sandbox_id))
            return cur.rowcount == 1

    @staticmethod
    def _rename_references(db: sqlite3.Connection, tag: str, new: str) -> None:
        """Inside a transaction: every lineage entry and sandbox ``snapshot_tag`` naming ``tag``
        names ``new`` instead (the snapshot called ``tag`` is going, and another may take the tag)."""
        needle = json.dumps(tag)  # tags hold no characters JSON escapes: the quoted form is exact
        for table, key in (("snapshots", "tag"), ("sandboxes", "id")):
            rows = db.execute(f"SELECT {key}, lineage FROM {table} WHERE instr(lineage, ?) > 0", (needle,)).fetchall()
            for key_value, lineage in rows:
                renamed = [new if t == tag else t for t in orjson.loads(lineage)]
                db.execute(f"UPDATE {table} SET lineage=? WHERE {key}=?", (json.dumps(renamed), key_value))
        db.execute("UPDATE sandboxes SET snapshot_tag=? WHERE snapshot_tag=?", (new, tag))

    def commit_workspace_state(self, name: str, pending: str, state_tag: str, *, lineage: list[str], spec: dict,
                               retired_as: str | None, workspace: dict) -> None:
        """One transaction that makes snapshot ``pending`` a workspace's state: the previous
        ``state_tag`` row (if any) goes, references to it are renamed ``retired_as``, ``pending`` is
        renamed ``state_tag`` (with ``lineage`` and ``spec``) and the workspace row gets ``workspace``."""
        with self.tx() as db:
            if retired_as is not None:
                db.execute("DELETE FROM snapshots WHERE tag=?", (state_tag,))
                self._rename_references(db, state_tag, retired_as)
            db.execute("UPDATE snapshots SET tag=?, lineage=?, spec=? WHERE tag=?",
                       (state_tag, json.dumps(lineage), json.dumps(spec), pending))
            enc = _encode(workspace)
            db.execute(f"UPDATE workspaces SET {', '.join(f'{k}=?' for k in enc)} WHERE name=?",
                       (*enc.values(), name))

    def delete_snapshot_renaming_references(self, tag: str, retired_as: str) -> None:
        """Delete a snapshot row; lineages and sandboxes that name it name ``retired_as`` instead."""
        with self.tx() as db:
            db.execute("DELETE FROM snapshots WHERE tag=?", (tag,))
            self._rename_references(db, tag, retired_as)
