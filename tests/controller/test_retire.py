"""Ending a template or sandbox never takes its live forks with it, even when its agent does not
answer (its init, not its agent, is PID 1 of their pid namespace), and a liveness check that cannot get a pidfd never calls a live sandbox dead (the server
drops, and kills, what it believes dead). A branch that fails once its template is up leaves no
template running that no record names."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from forkd_server.errors import EngineFailure

from ..conftest import requires_root, wait_gone
from .conftest import ev

pytestmark = requires_root


def test_a_deleted_snapshot_whose_agent_does_not_answer_is_ended_and_its_fork_runs_on(ctl):
    ctl.create_snapshot("frozen-parent", setup="x = 7")
    (kid,) = ctl.spawn("frozen-parent")
    template = ctl.registry.get_snapshot("frozen-parent")["handle"]
    os.kill(template["pid"], signal.SIGSTOP)  # its agent could answer nothing
    ctl.delete_snapshot("frozen-parent")
    assert wait_gone({template["pid"]}) == set()  # ended all the same: SIGKILL needs no answer
    assert ev(ctl, kid["id"], "x") == "7"  # its fork lives on: its init holds their namespace
    ctl.kill_sandbox(kid["id"])
    assert wait_gone({template["init"]["pid"]}) == set()  # and the init goes after its last fork


def test_no_pidfd_to_be_had_is_no_death(ctl, monkeypatch):
    (kid,) = ctl.spawn(ctl.create_snapshot("watched")["tag"])
    engine = ctl.engines["process"]
    handle = ctl.registry.get_sandbox(kid["id"])["handle"]
    with engine._pidfd_lock:  # no watcher cached: the next check opens one
        fd = engine._pidfds.pop((handle["pid"], handle["start_time"]), None)
    if fd is not None:
        os.close(fd)

    def out_of_descriptors(pid):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "pidfd_open", out_of_descriptors)
    assert engine.alive_many([handle]) == [True]
    assert kid["id"] in {s["id"] for s in ctl.list_sandboxes()}
    monkeypatch.undo()
    ctl.kill_sandbox(kid["id"])
    assert engine.alive_many([handle]) == [False]
    ctl.delete_snapshot("watched")


def test_a_branch_whose_template_reports_too_late_leaves_no_template(ctl, monkeypatch):
    (kid,) = ctl.spawn(ctl.create_snapshot("late-parent")["tag"])
    engine = ctl.engines["process"]
    real, reports = engine._read_report, []

    def late(sock, deadline):
        got = real(sock, deadline)
        reports.append(got)
        return None if len(reports) == 2 else got  # its "ok" arrives just past the deadline

    monkeypatch.setattr(engine, "_read_report", late)
    with pytest.raises(EngineFailure, match="the new snapshot exited"):
        ctl.branch(kid["id"], "late-branch", mode="full")
    monkeypatch.undo()
    template = reports[0][1]  # the pid its move request came with
    assert reports[1][0].get("ok") is True  # it did come up
    assert wait_gone({template}) == set()
    assert ev(ctl, kid["id"], "1 + 1") == "2"  # the source runs on
    ctl.kill_sandbox(kid["id"])
    ctl.delete_snapshot("late-parent")

