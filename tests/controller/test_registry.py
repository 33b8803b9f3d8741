"""The registry's table cache never serves stale rows."""

from __future__ import annotations

import os
import threading

import pytest

from forkd_server.controller.registry import Registry


def row(i: int) -> dict:
    return {"id": f"sb-{i}", "snapshot_tag": "t", "engine": "process", "status": "running",
            "created_at": 1.0, "lineage": ["t", f"sb-{i}"], "handle": {"pid": i, "start_time": 1}}


def test_cache_follows_commits_of_this_and_other_connections(short_dir):
    path = os.path.join(short_dir, "r.sqlite3")
    a, b = Registry(path), Registry(path)
    try:
        assert b.list_sandboxes() == []
        a.insert_sandboxes([row(1)])                 # another connection (another process, say)
        assert [r["id"] for r in b.list_sandboxes()] == ["sb-1"]
        b.update_sandbox("sb-1", branch_count=3)     # this connection's own commit
        assert b.list_sandboxes()[0]["branch_count"] == 3
        assert a.list_sandboxes()[0]["branch_count"] == 3
        a.delete_sandboxes(["sb-1"])
        assert b.list_sandboxes() == []
    finally:
        a.close()
        b.close()


def test_callers_cannot_change_what_the_next_reader_sees(short_dir):
    reg = Registry(os.path.join(short_dir, "r.sqlite3"))
    try:
        reg.insert_sandboxes([row(1)])
        first = reg.list_sandboxes()[0]
        first["status"] = "scribbled"
        assert reg.list_sandboxes()[0]["status"] == "running"
    finally:
        reg.close()


def test_generation_changes_with_every_commit_and_only_then(short_dir):
    path = os.path.join(short_dir, "r.sqlite3")
    a, b = Registry(path), Registry(path)
    try:
        a.insert_sandboxes([row(1)])
        gen, rows = b.sandbox_table()
        assert b.sandbox_table()[0] == gen and b.sandbox_table()[1] is rows  # unchanged: same objects
        b.update_sandbox("sb-1", branch_count=1)     # own commit
        gen2, rows2 = b.sandbox_table()
        assert gen2 != gen and rows2[0]["branch_count"] == 1
        a.insert_sandboxes([row(2)])                 # another connection's commit
        gen3, rows3 = b.sandbox_table()
        assert gen3 not in (gen, gen2) and [r["id"] for r in rows3] == ["sb-1", "sb-2"]
    finally:
        a.close()
        b.close()


def test_a_shared_sandbox_row_is_the_registrys_row_after_every_commit(short_dir):
    """The loop's read (``shared_sandbox``) decodes a row once and shares it until a commit: this
    connection's own, or another's (another process on the data dir); never a row from before."""
    path = os.path.join(short_dir, "r.sqlite3")
    a, b = Registry(path), Registry(path)
    try:
        a.insert_sandboxes([row(1)])
        first = b.shared_sandbox("sb-1")
        assert first == b.get_sandbox("sb-1") and b.shared_sandbox("sb-1") is first  # kept
        b.update_sandbox("sb-1", tier="frozen")                # this connection's commit
        assert b.shared_sandbox("sb-1")["tier"] == "frozen"
        a.update_sandbox("sb-1", tier=None, ending={"reason": "killed"})  # another connection's
        now = b.shared_sandbox("sb-1")
        assert now["tier"] is None and now["ending"] == {"reason": "killed"}
        a.set_sandbox_handles({"sb-1": {"pid": 7, "start_time": 2}})  # a new process behind the id
        assert b.shared_sandbox("sb-1")["handle"] == {"pid": 7, "start_time": 2}
        b.delete_sandboxes(["sb-1"], ended={"reason": "killed"})
        assert b.shared_sandbox("sb-1") is None
        a.insert_sandboxes([row(2)])
        assert b.shared_sandbox("sb-2")["id"] == "sb-2"
        a.delete_sandboxes(["sb-2"])
        assert b.shared_sandbox("sb-2") is None
    finally:
        a.close()
        b.close()


def test_a_shared_sandbox_row_never_waits_for_a_commit(short_dir):
    reg = Registry(os.path.join(short_dir, "r.sqlite3"))
    try:
        reg.insert_sandboxes([row(1)])
        assert reg.shared_sandbox("sb-1")["id"] == "sb-1"
        inside, done = threading.Event(), threading.Event()

        def commit() -> None:  # a commit under way on another thread holds the registry
            with reg.tx():
                inside.set()
                done.wait(30)

        committer = threading.Thread(target=commit)
        committer.start()
        try:
            assert inside.wait(30)
            with pytest.raises(BlockingIOError):
                reg.shared_sandbox("sb-1")
        finally:
            done.set()
            committer.join(30)
        assert reg.shared_sandbox("sb-1")["id"] == "sb-1"
    finally:
        reg.close()


def test_a_registry_from_before_workspaces_gains_the_table(short_dir):
    """The schema only adds tables (CREATE TABLE IF NOT EXISTS): an older registry opens unchanged."""
    import sqlite3

    path = os.path.join(short_dir, "old.sqlite3")
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE sandboxes (id TEXT PRIMARY KEY, snapshot_tag TEXT NOT NULL, engine TEXT NOT NULL, "
                     "status TEXT NOT NULL, created_at REAL NOT NULL, lineage TEXT NOT NULL, memory_limit_mib INTEGER, "
                     "branch_count INTEGER NOT NULL DEFAULT 0, handle TEXT);")
    db.execute("INSERT INTO sandboxes (id, snapshot_tag, engine, status, created_at, lineage) "
               "VALUES ('sb-1', 't', 'process', 'running', 1.0, '[\"t\", \"sb-1\"]')")
    db.commit()
    db.close()
    reg = Registry(path)
    try:
        assert [r["id"] for r in reg.list_sandboxes()] == ["sb-1"]
        assert reg.list_workspaces() == []
        reg.insert_workspace({"name": "w", "id": "ws-sb-1", "source_snapshot_tag": "t", "status": "running",
                              "live_sandbox_id": "sb-1", "created_at": 1.0, "last_active": 1.0})
        assert reg.get_workspace("w")["live_sandbox_id"] == "sb-1"
    finally:
        reg.close()


def test_sandbox_numbers_begin_at_random_per_data_dir_and_then_count_on(short_dir):
    """Hosts behind one router that all began at 0 handed out the same ids (``sb-<second>-<n>``)
    when a spawn split over them; a new registry's numbering begins anywhere in the 16 bits the id
    shows, and a reopened one counts on from where it was."""
    firsts = []
    for i in range(5):
        path = os.path.join(short_dir, f"n{i}.sqlite3")
        reg = Registry(path)
        try:
            rows = reg.insert_numbered_sandboxes(3, lambda first: [row(first + k) for k in range(3)])
            first = int(rows[0]["id"][3:])
            assert [r["id"] for r in rows] == [f"sb-{first + k}" for k in range(3)]
            assert 0 <= first < 0x10000
        finally:
            reg.close()
        reg = Registry(path)  # reopened, as by a restarted server: no new start
        try:
            assert reg.insert_numbered_sandboxes(1, lambda n: [row(n)])[0]["id"] == f"sb-{first + 3}"
        finally:
            reg.close()
        firsts.append(first)
    assert len(set(firsts)) > 1, firsts  # five starts all alike: 1 in 2**64 by chance


def test_a_spawns_rows_skip_only_the_fsync(short_dir):
    """A spawn's two transactions commit without waiting for the disk (their rows die with the host
    anyway), yet atomically and seen by other connections; every other change stays synchronous=FULL,
    also after a spawn's transaction failed."""
    path = os.path.join(short_dir, "r.sqlite3")
    a, b = Registry(path), Registry(path)
    full = 2  # PRAGMA synchronous: 1 NORMAL, 2 FULL
    try:
        seen = []

        def rows_from(first: int) -> list[dict]:
            seen.append(a._db.execute("PRAGMA synchronous").fetchone()[0])
            return [row(first + i) for i in range(2)]

        rows = a.insert_numbered_sandboxes(2, rows_from)
        assert seen == [1]
        assert a._db.execute("PRAGMA synchronous").fetchone()[0] == full
        a.set_sandbox_handles({r["id"]: {"pid": 7, "start_time": 1} for r in rows})
        assert a._db.execute("PRAGMA synchronous").fetchone()[0] == full
        assert sorted(r["handle"]["pid"] for r in b.list_sandboxes()) == [7, 7]

        def broken(first: int) -> list[dict]:
            raise RuntimeError("no rows")

        with pytest.raises(RuntimeError):
            a.insert_numbered_sandboxes(1, broken)
        assert a._db.execute("PRAGMA synchronous").fetchone()[0] == full
        assert len(b.list_sandboxes()) == 2  # rolled back: nothing of it
    finally:
        a.close()
        b.close()
