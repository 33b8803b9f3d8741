"""A snapshot's setup is user code: it runs within a sandbox's limits (pids, memory, time), and
DELETE of a snapshot being created cancels it. Nothing of a stopped setup stays."""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest

from forkd_server.errors import BadRequest, Conflict, NotFound

from ..conftest import requires_root
from .conftest import ev

pytestmark = requires_root

FORK_BOMB = """
import os, time
for i in range(1500):
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
"""


def setup_leaves(ctl, tag: str) -> list[str]:
    engine = ctl.engines["process"]
    from forkd_engine.cgroups import locate
    return [leaf for c in ("memory", "pids")
            for leaf in glob.glob(os.path.join(locate(c)[1], engine.cgroups.group, f"setup-{tag}-*"))]


def test_a_setup_that_forks_1500_times_is_stopped_by_the_pids_limit(ctl):
    with pytest.raises(BadRequest) as failure:  # the request's own setup: a 400
        ctl.create_snapshot("fork-bomb", setup=FORK_BOMB)
    error = failure.value
    assert "BlockingIOError" in error.details["traceback"]  # fork() was refused inside the setup
    assert error.what.startswith(f"snapshot fork-bomb: its setup was stopped by its limits: the pids limit "
                                 f"({ctl.engines['process'].pids_max} processes and threads) refused a fork")
    assert error.hint == ("nothing was created: start fewer processes and threads in it, and create the snapshot "
                          "again")
    with pytest.raises(NotFound):
        ctl.get_snapshot("fork-bomb")
    assert not any(os.path.exists(leaf) for leaf in setup_leaves(ctl, "fork-bomb"))  # and every fork is gone


def test_a_setup_over_its_memory_limit_is_stopped_saying_so(ctl):
    with pytest.raises(BadRequest, match="its setup was stopped by its limits: the memory limit was reached") as failure:
        ctl.create_snapshot("too-big", setup="blob = bytearray(400 * 2**20)", memory_limit_mib=128)
    assert "128 MiB" in failure.value.what and "memory_limit_mib" in failure.value.hint
    assert ctl.create_snapshot("big-enough", setup="blob = bytearray(100 * 2**20)", memory_limit_mib=256)["status"] == "ready"
    kid = ctl.spawn("big-enough", 1)[0]["id"]
    assert ev(ctl, kid, "len(blob)") == str(100 * 2**20)
    ctl.kill_sandbox(kid)
    ctl.delete_snapshot("big-enough")


def test_a_setup_over_time_is_stopped_with_a_clear_error(ctl):
    t0 = time.monotonic()
    with pytest.raises(BadRequest, match=r"did not finish within 3 s \(setup_timeout_secs"):
        ctl.create_snapshot("slow", setup="import time\ntime.sleep(600)", setup_timeout_secs=3)
    assert time.monotonic() - t0 < 30
    with pytest.raises(NotFound):
        ctl.get_snapshot("slow")
    assert not any(os.path.exists(leaf) for leaf in setup_leaves(ctl, "slow"))


def test_delete_of_a_snapshot_being_created_cancels_it(ctl):
    outcome = {}

    def create():
        try:
            outcome["info"] = ctl.create_snapshot("doomed", setup="import time\ntime.sleep(600)")
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    creator = threading.Thread(target=create)
    creator.start()
    deadline = time.monotonic() + 30
    while not any(os.path.exists(os.path.join(leaf, "cgroup.procs")) and open(os.path.join(leaf, "cgroup.procs")).read()
                  for leaf in setup_leaves(ctl, "doomed")):
        assert time.monotonic() < deadline, "the setup never started"
        time.sleep(0.01)                                     # bounded: until its processes exist
    assert ctl.get_snapshot("doomed")["status"] == "writing"
    t0 = time.monotonic()
    ctl.delete_snapshot("doomed")                            # returns once nothing of it stays
    assert time.monotonic() - t0 < 30
    creator.join(30)
    assert isinstance(outcome.get("error"), Conflict) and "deleted while it was being created" in str(outcome["error"])
    with pytest.raises(NotFound):
        ctl.get_snapshot("doomed")
    assert not any(os.path.exists(leaf) for leaf in setup_leaves(ctl, "doomed"))
    ctl.create_snapshot("doomed", setup="x = 1")             # the tag is free again
    ctl.delete_snapshot("doomed")
