"""Workspaces (suspend/resume into ws-<name>-state) and compact, on real process sandboxes."""

from __future__ import annotations

import os
import signal

import pytest
from forkd_engine import EngineError

from forkd_server.controller import Controller
from forkd_server.errors import BadRequest, Busy, Conflict, EngineFailure, NotFound

from ..conftest import engine_processes, requires_root, wait_gone
from .conftest import cleanup, ev, sh

pytestmark = requires_root


@pytest.fixture(scope="module")
def src(ctl):
    return ctl.create_snapshot("ws-src", setup="note = 'from setup'")["tag"]


def states(ctl: Controller, name: str) -> list[str]:
    """Tags of the workspace's state snapshots, pending ones (``...@n``) included."""
    return sorted(s["tag"] for s in ctl.list_snapshots() if s["tag"].startswith(f"ws-{name}-state"))


def kill_outside(pid: int) -> None:
    """A sandbox dies without the controller knowing (kill -9 from outside)."""
    os.kill(pid, signal.SIGKILL)
    assert wait_gone({pid}) == set()


# --- the lifecycle ------------------------------------------------------------------------------

def test_state_survives_suspend_and_resume(ctl, src):
    ws = ctl.create_workspace("life", src)
    sid = ws["live_sandbox_id"]
    assert ws["status"] == "running" and ws["id"] == "ws-" + sid[:16] and ws["source_snapshot_tag"] == src
    assert "current_state_tag" not in ws and ws["last_active_unix"] >= ws["created_at_unix"]
    ctl.run_code(sid, "note = 'set before suspend'\nbig = list(range(100_000))")
    sh(ctl, sid, "echo kept > /tmp/work.txt")

    suspended = ctl.suspend_workspace("life")
    assert suspended["status"] == "suspended" and suspended["current_state_tag"] == "ws-life-state"
    assert "live_sandbox_id" not in suspended and suspended["id"] == ws["id"]
    assert sid not in {s["id"] for s in ctl.list_sandboxes()}       # the sandbox was killed
    assert states(ctl, "life") == ["ws-life-state"]                  # no pending snapshot left
    state = ctl.get_snapshot("ws-life-state")
    assert state["branched_from"] == sid and state["lineage"] == [src, sid, "ws-life-state"]
    assert state["pause_ms"] >= 0

    resumed = ctl.resume_workspace("life")
    new = resumed["live_sandbox_id"]
    assert resumed["status"] == "running" and new != sid and resumed["id"] == ws["id"]
    assert ev(ctl, new, "note") == "'set before suspend'"
    assert ev(ctl, new, "len(big)") == "100000"
    assert sh(ctl, new, "cat /tmp/work.txt")["stdout"] == "kept\n"
    assert ctl.get_workspace("life") == resumed
    assert [w["name"] for w in ctl.list_workspaces()] == ["life"]

    ctl.delete_workspace("life")
    assert new not in {s["id"] for s in ctl.list_sandboxes()}
    assert states(ctl, "life") == []
    with pytest.raises(NotFound, match="^workspace life not found$"):
        ctl.get_workspace("life")


def test_a_second_suspend_replaces_the_state(ctl, src):
    ctl.create_workspace("twice", src, memory_limit_mib=512)
    sid = ctl.get_workspace("twice")["live_sandbox_id"]
    ctl.run_code(sid, "note = 'first'")
    ctl.suspend_workspace("twice")
    first_state = ctl.registry.get_snapshot("ws-twice-state")
    sid = ctl.resume_workspace("twice")["live_sandbox_id"]
    assert ctl.get_sandbox(sid)["memory_limit_mib"] == 512             # the limit is kept on resume
    # a sandbox forked from the first state by hand: a dependent of the state being replaced
    bystander = ctl.spawn("ws-twice-state", 1)[0]["id"]
    ctl.run_code(sid, "note = 'second'")

    info = ctl.suspend_workspace("twice", diff=True)
    assert info["status"] == "suspended" and states(ctl, "twice") == ["ws-twice-state"]
    second_state = ctl.registry.get_snapshot("ws-twice-state")
    assert second_state["handle"] != first_state["handle"] and second_state["spec"]["mode"] == "diff"
    # lineage stays short: the source, the sandbox it was taken from, the state
    assert second_state["lineage"] == [src, sid, "ws-twice-state"]
    assert ctl.registry.get_workspace("twice")["retiring"] is None    # sandbox and old state retired
    # the dependent keeps running; it now names the old state by the tag it was written under
    assert ev(ctl, bystander, "note") == "'first'"
    renamed = ctl.get_sandbox(bystander)
    assert renamed["snapshot_tag"] == first_state["spec"]["engine_tag"] and "@" in renamed["snapshot_tag"]
    assert "ws-twice-state" not in renamed["lineage"]
    assert bystander not in ctl.snapshot_detail("ws-twice-state")["sandboxes"]

    sid = ctl.resume_workspace("twice")["live_sandbox_id"]
    assert ev(ctl, sid, "note") == "'second'"
    ctl.kill_sandbox(bystander)
    ctl.delete_workspace("twice")


def test_the_state_snapshot_is_guarded(ctl, src):
    ctl.create_workspace("guard", src)
    ctl.suspend_workspace("guard")
    with pytest.raises(Conflict, match="holds the state of workspace guard"):
        ctl.delete_snapshot("ws-guard-state")
    with pytest.raises(Conflict, match="cascade from ws-src would delete it"):
        ctl.delete_snapshot(src, cascade=True)
    ctl.delete_workspace("guard")
    assert states(ctl, "guard") == []


def test_a_killed_sandbox_makes_the_workspace_stale_and_resume_recovers(ctl, src):
    ws = ctl.create_workspace("stale", src)
    ctl.run_code(ws["live_sandbox_id"], "note = 'lost'")
    ctl.kill_sandbox(ws["live_sandbox_id"])                   # through the sandbox API
    info = ctl.get_workspace("stale")
    assert info["status"] == "stale" and "live_sandbox_id" not in info
    with pytest.raises(BadRequest, match="not running"):
        ctl.suspend_workspace("stale")
    sid = ctl.resume_workspace("stale")["live_sandbox_id"]   # never suspended: from the source
    assert ev(ctl, sid, "note") == "'from setup'"

    # dead without anyone noticing, then suspended: forkd's order says 404, and it becomes stale
    kill_outside(ctl.get_sandbox(sid)["pid"])
    with pytest.raises(NotFound, match=f"sandbox {sid} not found"):
        ctl.suspend_workspace("stale")
    assert ctl.get_workspace("stale")["status"] == "stale"
    ctl.delete_workspace("stale")


# --- check order and errors ---------------------------------------------------------------------

def test_create_check_order(ctl, src):
    with pytest.raises(BadRequest, match="invalid name"):
        ctl.create_workspace("../x", "-bad")                 # the name first
    with pytest.raises(BadRequest, match="at most 55"):
        ctl.create_workspace("n" * 56, src)
    with pytest.raises(BadRequest, match="invalid snapshot_tag"):
        ctl.create_workspace("ok", "-bad")
    with pytest.raises(NotFound, match="snapshot nope not found"):
        ctl.create_workspace("ok", "nope")
    with pytest.raises(BadRequest, match="memory_limit_mib"):
        ctl.create_workspace("ok", src, memory_limit_mib=1)
    ctl.create_workspace("n" * 55, src)
    with pytest.raises(BadRequest, match="invalid snapshot_tag"):
        ctl.create_workspace("n" * 55, "-bad")               # an unsafe snapshot_tag before "exists"
    with pytest.raises(Conflict, match=f"workspace {'n' * 55} already exists"):
        ctl.create_workspace("n" * 55, src)
    ctl.delete_workspace("n" * 55)
    ctl.create_snapshot("ws-taken-state", setup=None)     # somebody's snapshot has the state tag
    with pytest.raises(Conflict, match="ws-taken-state already exists"):
        ctl.create_workspace("taken", src)
    ctl.delete_snapshot("ws-taken-state")
    assert ctl.list_workspaces() == []


def test_operations_check_order(ctl, src):
    for call in (lambda: ctl.get_workspace("ghost"), lambda: ctl.delete_workspace("ghost"),
                 lambda: ctl.suspend_workspace("ghost"), lambda: ctl.resume_workspace("ghost")):
        with pytest.raises(NotFound, match="^workspace ghost not found$"):
            call()
    ctl.create_workspace("order", src)
    with pytest.raises(BadRequest, match="already running"):
        ctl.resume_workspace("order")
    # busy: another operation holds it -> 409; the state tag in flight -> 409; the cap -> 503
    ctl.workspaces._acquire("order", "suspend")
    try:
        for call in (lambda: ctl.suspend_workspace("order"), lambda: ctl.delete_workspace("order")):
            with pytest.raises(Conflict, match="busy"):
                call()
        assert ctl.get_workspace("order")["status"] == "running"   # reading never waits
    finally:
        ctl.workspaces._release("order")
    release = ctl.branches.take_slot("ws-order-state")
    try:
        with pytest.raises(Conflict, match="in flight"):
            ctl.suspend_workspace("order")
    finally:
        release()
    releases = [ctl.branches.take_slot(f"held-{i}") for i in range(ctl.branch_cap)]
    try:
        with pytest.raises(Busy):
            ctl.suspend_workspace("order")
    finally:
        for release in releases:
            release()
    assert ctl.branches.slots_in_use == 0 and not ctl.branches.in_flight and not ctl.workspaces._busy
    ctl.suspend_workspace("order")
    with pytest.raises(BadRequest, match="not running"):
        ctl.suspend_workspace("order")
    ctl.delete_workspace("order")


def test_suspend_never_overwrites_a_snapshot_it_does_not_own(ctl, src):
    ws = ctl.create_workspace("squat", src)
    ctl.create_snapshot("ws-squat-state", setup="note = 'somebody else'")  # after the create: allowed
    with pytest.raises(Conflict, match="not workspace squat's state"):
        ctl.suspend_workspace("squat")
    assert ctl.get_workspace("squat")["live_sandbox_id"] == ws["live_sandbox_id"]
    kid = ctl.spawn("ws-squat-state", 1)[0]["id"]
    assert ev(ctl, kid, "note") == "'somebody else'"
    ctl.kill_sandbox(kid)
    ctl.delete_snapshot("ws-squat-state")
    assert ctl.suspend_workspace("squat")["status"] == "suspended"
    ctl.delete_workspace("squat")


def test_a_failed_suspend_keeps_the_workspace_running(ctl, src, monkeypatch):
    ws = ctl.create_workspace("keep", src)
    ctl.run_code(ws["live_sandbox_id"], "note = 'unsaved'")
    engine = ctl.engines["process"]

    def broken(*args, **kwargs):
        raise EngineError("injected: the engine could not write the branch")

    monkeypatch.setattr(engine, "branch", broken)
    with pytest.raises(EngineFailure):
        ctl.suspend_workspace("keep")
    monkeypatch.undo()
    info = ctl.get_workspace("keep")
    assert info["status"] == "running" and info["live_sandbox_id"] == ws["live_sandbox_id"]
    assert ev(ctl, ws["live_sandbox_id"], "note") == "'unsaved'"
    assert states(ctl, "keep") == [] and ctl.branches.slots_in_use == 0 and not ctl.branches.in_flight
    ctl.delete_workspace("keep")


def test_a_suspend_that_fails_after_its_write_leaves_no_pending_state(ctl, src, monkeypatch):
    """The state was written under its pending tag (``...@n``, which no user can delete), then the
    swap failed: the pending state and its template go, the workspace runs on."""
    ws = ctl.create_workspace("undo", src)
    before = engine_processes(ctl.data_dir)
    written = []

    def refused(row, pending, *args):
        written.append(pending)
        raise RuntimeError("injected: the registry refused the swap")

    monkeypatch.setattr(ctl.workspaces, "_commit_state", refused)
    with pytest.raises(RuntimeError, match="injected"):
        ctl.suspend_workspace("undo")
    monkeypatch.undo()
    assert written[0]["status"] == "ready" and "@" in written[0]["tag"]
    assert states(ctl, "undo") == []
    # its template ended; wait_gone counts an exited one its sandbox has not reaped yet as gone
    assert wait_gone(engine_processes(ctl.data_dir) - before) == set()
    info = ctl.get_workspace("undo")
    assert info["status"] == "running" and info["live_sandbox_id"] == ws["live_sandbox_id"]
    assert ctl.suspend_workspace("undo")["status"] == "suspended"
    ctl.delete_workspace("undo")


# --- restarts -----------------------------------------------------------------------------------

def test_restart_keeps_workspaces_and_marks_a_killed_one_stale(short_dir):
    before = engine_processes(short_dir)
    c = Controller(short_dir)
    try:
        c.create_snapshot("r", setup="note = 'source'")
        running = c.create_workspace("running", "r")
        c.run_code(running["live_sandbox_id"], "note = 'live'")
        c.create_workspace("parked", "r")
        c.run_code(c.get_workspace("parked")["live_sandbox_id"], "note = 'parked'")
        c.suspend_workspace("parked")
        doomed = c.create_workspace("doomed", "r")
        pid = c.get_sandbox(doomed["live_sandbox_id"])["pid"]
        c.close()
        kill_outside(pid)                                   # dies while no server runs

        c = Controller(short_dir)
        by_name = {w["name"]: w for w in c.list_workspaces()}
        assert {n: w["status"] for n, w in by_name.items()} == \
            {"running": "running", "parked": "suspended", "doomed": "stale"}
        assert by_name["running"] == dict(running, last_active_unix=by_name["running"]["last_active_unix"])
        assert ev(c, by_name["running"]["live_sandbox_id"], "note") == "'live'"
        assert ev(c, c.resume_workspace("parked")["live_sandbox_id"], "note") == "'parked'"
        assert ev(c, c.resume_workspace("doomed")["live_sandbox_id"], "note") == "'source'"
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


@pytest.mark.parametrize("sandbox_survives", [True, False])
def test_a_suspend_cut_short_is_settled_by_the_restart(short_dir, monkeypatch, sandbox_survives):
    """The server dies after the new state is written and before it becomes the workspace's state."""
    before = engine_processes(short_dir)
    c = Controller(short_dir)
    try:
        c.create_snapshot("r", setup="note = 'source'")
        sid = c.create_workspace("cut", "r")["live_sandbox_id"]
        c.run_code(sid, "note = 'written'")

        def crash(*args, **kwargs):
            raise SystemExit("injected: the server died here")

        monkeypatch.setattr(c.workspaces, "_commit_state", crash)
        with pytest.raises(SystemExit):
            c.suspend_workspace("cut")
        pending = [t for t in states(c, "cut") if "@" in t]
        assert len(pending) == 1 and c.registry.get_snapshot(pending[0])["status"] == "ready"
        assert c.get_workspace("cut")["status"] == "running"
        if not sandbox_survives:
            # killed through the API meanwhile (a SIGKILL would take the state with it: the
            # process engine nests a branch in its source's pid namespace until the source retires)
            c.kill_sandbox(sid)
        c.close()

        c = Controller(short_dir)
        info = c.get_workspace("cut")
        if sandbox_survives:   # the sandbox is newer than the pending state: the state is dropped
            assert info["status"] == "running" and info["live_sandbox_id"] == sid
            assert states(c, "cut") == []
            assert ev(c, sid, "note") == "'written'"
        else:                  # the sandbox is gone: the suspend finishes, nothing is lost
            assert info["status"] == "suspended" and states(c, "cut") == ["ws-cut-state"]
            assert ev(c, c.resume_workspace("cut")["live_sandbox_id"], "note") == "'written'"
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


# --- compact ------------------------------------------------------------------------------------

def test_compact_copy_survives_deleting_its_source(ctl):
    ctl.create_snapshot("cmp-src", setup="value = 'compacted'")
    sandboxes = {s["id"] for s in ctl.list_sandboxes()}
    info = ctl.compact_snapshot("cmp-src", "cmp-copy")
    assert info["tag"] == "cmp-copy" and info["status"] == "ready" and info["bootable"] is True
    assert info["branched_from"] == "compact:cmp-src" and info["lineage"] == ["cmp-copy"]
    assert "pause_ms" not in info
    assert {s["id"] for s in ctl.list_sandboxes()} == sandboxes     # the helper sandbox was killed
    ctl.delete_snapshot("cmp-src", cascade=True)                     # the copy is no descendant
    kid = ctl.spawn("cmp-copy", 1)[0]["id"]
    assert ev(ctl, kid, "value") == "'compacted'"
    ctl.kill_sandbox(kid)
    ctl.delete_snapshot("cmp-copy")


def test_compact_check_order(ctl, src):
    with pytest.raises(BadRequest, match="invalid tag"):
        ctl.compact_snapshot("-x", "-y")
    with pytest.raises(BadRequest, match="invalid to"):
        ctl.compact_snapshot("nope", "a/b")
    with pytest.raises(BadRequest, match="must differ"):
        ctl.compact_snapshot("nope", "nope")
    releases = [ctl.branches.take_slot(f"held-{i}") for i in range(ctl.branch_cap)]
    try:
        with pytest.raises(Busy):
            ctl.compact_snapshot("nope", src)                # the slot comes before "exists"
    finally:
        for release in releases:
            release()
    release = ctl.branches.take_slot("in-flight")
    try:
        with pytest.raises(Conflict, match="in flight"):
            ctl.compact_snapshot(src, "in-flight")
    finally:
        release()
    with pytest.raises(Conflict, match=f"snapshot {src} already exists"):
        ctl.compact_snapshot("nope", src)                    # "to exists" before "unknown source"
    with pytest.raises(NotFound, match="snapshot nope not found"):
        ctl.compact_snapshot("nope", "fresh")
    assert ctl.branches.slots_in_use == 0 and not ctl.branches.in_flight
    assert "fresh" not in {s["tag"] for s in ctl.list_snapshots()}
