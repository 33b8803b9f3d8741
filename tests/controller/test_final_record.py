"""A snapshot whose final record the registry refuses (a full disk hits just that write) never stays
``writing``: it reads as ``failed`` saying why at once, its template is ended, its branch slot goes
back, and the record is written as soon as the registry takes writes again. Before, the row stayed
``writing`` until a restart, and a waiting branch never returned."""

from __future__ import annotations

import sqlite3

import pytest

from forkd_server.errors import EngineFailure
from forkd_server.controller.storage import is_disk_full

from ..conftest import requires_root

pytestmark = requires_root

FULL = sqlite3.OperationalError("database or disk is full")


@pytest.fixture
def refusing(ctl, monkeypatch):
    """The registry refuses a snapshot's final records (status ready or failed) while ``on``."""
    from forkd_server.controller import branching
    monkeypatch.setattr(branching, "SETTLE_RETRY", 0.05)  # the retry's pause: nothing to wait out here
    state = {"on": True, "refused": 0}
    real = ctl.registry.update_snapshot

    def update_snapshot(tag, **fields):
        if state["on"] and fields.get("status") in ("ready", "failed"):
            state["refused"] += 1
            raise FULL
        return real(tag, **fields)

    monkeypatch.setattr(ctl.registry, "update_snapshot", update_snapshot)
    return state


def test_a_refused_final_record_of_a_branch_leaves_it_failed_and_its_template_ended(ctl, snap, refusing):
    sb = ctl.spawn(snap, 1)[0]["id"]
    engine = ctl.engines["process"]
    ended = []
    real_delete = engine.delete_snapshot
    engine.delete_snapshot = lambda handle: (ended.append(handle), real_delete(handle))[1]
    try:
        with pytest.raises(EngineFailure) as failure:
            ctl.branch(sb, "unrecorded")
    finally:
        del engine.delete_snapshot
    assert is_disk_full(failure.value)                          # the REST answer is 507
    info = ctl.get_snapshot("unrecorded")
    assert info["status"] == "failed" and "record could not be" in info["warning"], info
    assert [s["status"] for s in ctl.list_snapshots() if s["tag"] == "unrecorded"] == ["failed"]
    assert {n["id"]: n["status"] for n in ctl.tree()}["unrecorded"] == "failed"
    assert len(ended) == 1 and not engine.alive(ended[0])      # no template runs that no record names
    assert ctl.branches.slots_in_use == 0
    assert ctl.registry.get_snapshot("unrecorded")["status"] == "writing"  # the registry still refuses
    refusing["on"] = False                                      # room again: the retry writes it
    assert ctl.branches.unsettled_idle.wait(30)
    assert ctl.registry.get_snapshot("unrecorded")["status"] == "failed"
    ctl.delete_snapshot("unrecorded")
    ctl.kill_sandbox(sb)


def test_a_refused_final_record_of_a_create_leaves_it_failed(ctl, refusing):
    with pytest.raises(EngineFailure, match="its record could not be written") as failure:
        ctl.create_snapshot("unrecorded-create", setup="x = 1")
    assert is_disk_full(failure.value)
    assert ctl.get_snapshot("unrecorded-create")["status"] == "failed"
    refusing["on"] = False
    assert ctl.branches.unsettled_idle.wait(30)
    assert ctl.registry.get_snapshot("unrecorded-create")["status"] == "failed"
    ctl.delete_snapshot("unrecorded-create")
