"""No cgroup leaf outlives what it held: killed sandboxes, retired reapers, compact helpers, failed
setups, and the engine's own group once it closes empty. Runs of the suite used to leave hundreds of
empty leaves under /sys/fs/cgroup/{memory,pids}/forkd*."""

from __future__ import annotations

import os

import pytest

from forkd_engine.cgroups import CONTROLLERS, locate
from forkd_server.controller import Controller
from forkd_server.errors import BadRequest, Gone

from ..conftest import requires_root
from .conftest import cleanup

pytestmark = requires_root


@pytest.fixture
def own(short_dir):
    """A controller of its own, so its group can be checked from creation to close."""
    ctl = Controller(short_dir)
    yield ctl
    cleanup(ctl)
    ctl.close()


def groups(ctl) -> list[str]:
    """This engine's group directory in each hierarchy it uses (whether it exists or not)."""
    group = ctl.engines["process"].cgroups.group
    return [os.path.join(where[1], group) for where in map(locate, CONTROLLERS) if where is not None]


def leaves(ctl) -> set[str]:
    """Every leaf of this engine, by name (e.g. ``sb-...``, ``setup-base-...``)."""
    return {name for g in groups(ctl) if os.path.isdir(g) for name in os.listdir(g)
            if os.path.isdir(os.path.join(g, name))}


def settled(ctl) -> set[str]:
    """The leaves once the engine's janitor has removed every leaf it was given (their last process
    exits on its own time: a reaper after its last fork)."""
    assert ctl.engines["process"].cgroups.janitor.idle.wait(30), "leaves still held after 30 s"
    return leaves(ctl)


def test_a_spawn_kill_cycle_leaves_no_leaf_and_close_removes_the_group(own):
    own.create_snapshot("base", setup="x = 1")
    template = leaves(own)
    for _ in range(3):
        sb = own.spawn("base", 2)
        assert {s["id"] for s in sb} <= leaves(own)
        for s in sb:
            own.kill_sandbox(s["id"])
        assert leaves(own) == template                       # at once: kill waits for the exit
    own.delete_snapshot("base")
    assert settled(own) == set()
    own.engines["process"].close()                           # as the server's close does
    assert not any(os.path.exists(g) for g in groups(own))   # the engine's group went too


def test_a_killed_sandbox_that_left_a_reaper_loses_its_leaves_when_the_reaper_goes(own):
    own.create_snapshot("base", setup="x = 1")
    sb = own.spawn("base", 1)[0]["id"]
    own.branch(sb, "br")
    own.kill_sandbox(sb)                                     # its branch lives on: a reaper holds its leaves
    assert sb in leaves(own)
    own.delete_snapshot("br")                                # the reaper's last fork: it exits
    assert sb not in settled(own)                            # and its leaves go, with no other kill after
    own.compact_snapshot("base", "copy")                     # the compact's helper, killed, is a reaper too
    own.delete_snapshot("copy")
    own.delete_snapshot("base")
    assert settled(own) == set()


def test_a_sandbox_that_died_of_its_limit_loses_its_leaves(own):
    own.create_snapshot("base", setup="x = 1")
    sb = own.spawn("base", 1, memory_limit_mib=64)[0]["id"]
    with pytest.raises(Gone, match="memory limit"):
        own.eval(sb, "len(b'x' * (200 * 2**20))")
    own.delete_snapshot("base")
    assert settled(own) == set()


def test_a_snapshot_made_again_under_its_tag_never_touches_the_leaves_of_the_one_before(own):
    """A deleted snapshot's template retires to a reaper in its setup leaves while its children run.
    A setup of the same tag that fails used to kill every process of "its" leaves: the reaper, and
    with its pid namespace every child of the snapshot before."""
    own.create_snapshot("x", setup="v = 1")
    child = own.spawn("x", 1)[0]["id"]
    own.compact_snapshot("x", "copy")  # its template nests in the killed helper's reaper, nested in x's
    own.delete_snapshot("x")
    with pytest.raises(BadRequest):
        own.create_snapshot("x", setup="raise ValueError('no')")
    assert own.ping(child)["pong"] is True
    assert own.eval(child, "v")["result"] == "1"
    # the compact flake of schemathesis: a copy whose source's tag was made again, and failed, died
    # with it, and a compact of it then failed half-way (500 "... exited")
    assert own.get_snapshot("copy")["status"] == "ready"
    assert own.compact_snapshot("copy", "copy2")["status"] == "ready"
    own.kill_sandbox(child)
    own.delete_snapshot("copy2")
    own.delete_snapshot("copy")
    assert settled(own) == set()


def test_a_close_right_after_the_last_deletes_still_removes_everything(own):
    """The server stops right after its cleanup (as every test server does): the reapers that the
    last deletes set exiting are given the moment they need, and nothing of the engine stays."""
    own.create_snapshot("base", setup="x = 1")
    sb = own.spawn("base", 1)[0]["id"]
    own.branch(sb, "br")
    own.kill_sandbox(sb)            # a reaper (its branch lives), nested in base's template
    own.delete_snapshot("base")     # a reaper too (its fork, the sandbox's reaper, lives)
    own.delete_snapshot("br")       # the chain's last fork: both reapers exit now, one after the other
    own.engines["process"].close()  # at once, as the server's close does
    assert not any(os.path.exists(g) for g in groups(own))
