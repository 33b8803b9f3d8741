"""One run of the suite, in one process or in parallel (pytest-xdist, ``-n``).

- What a run shares: a directory of its own ($FORKD_TEST_RUN_DIR) holding the VM engine's image
  cache ($FORKD_VM_CACHE, unless set), and forkd-init's build cache pinned where it is for this user.
- Groups: a worker takes a whole group at a time: a module by default, so module fixtures (a server,
  a controller, a snapshot) start once; tests sharing a session fixture that is costly to make twice,
  or that a second worker would rebuild under them, form one group (``SHARED``: tests/vm, tests/lab).
  Groups with an ``exclusive`` test start first (with that test), then shared groups and groups
  with a test marked ``slow``, so that none is left to run alone at the end.
- ``exclusive``: a test so marked runs while no other test of the run does (it reads or changes
  host-wide state, e.g. the huge-page pool).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile

import pytest

RUN_DIR = "FORKD_TEST_RUN_DIR"  # this run's own directory, made by the process that starts the run


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: its controller made the run's directory
        return
    run_dir = tempfile.mkdtemp(prefix="fkrun")
    config.stash[_made] = {RUN_DIR: run_dir}
    os.environ[RUN_DIR] = run_dir  # workers and every server and kernel the tests start inherit it
    if not os.environ.get("FORKD_CACHE_DIR"):
        # forkd-init's build cache, where it is for this user: tests/server gives each test a HOME of
        # its own (pytest_jupyter), under which every server would compile forkd-init again
        from forkd_engine.process.sandbox_init import cache_dir
        os.environ["FORKD_CACHE_DIR"] = cache_dir()
        config.stash[_made]["FORKD_CACHE_DIR"] = cache_dir()
    if not os.environ.get("FORKD_VM_CACHE"):
        # One guest image (and packages disk) per run, built by the first engine that needs it while
        # the others wait for it (forkd_engine.vm.image.cache_lock), whichever worker, server or
        # kernel it is in. Set FORKD_VM_CACHE to keep one between runs: its entries are keyed by
        # every input, so a changed agent or builder builds afresh.
        os.environ["FORKD_VM_CACHE"] = os.path.join(run_dir, "vm-cache")
        config.stash[_made]["FORKD_VM_CACHE"] = os.environ["FORKD_VM_CACHE"]


def pytest_unconfigure(config):
    made = config.stash.get(_made, {})
    for name in made:
        os.environ.pop(name, None)
    if RUN_DIR in made:
        shutil.rmtree(made[RUN_DIR], ignore_errors=True)


_made = pytest.StashKey[dict]()


@contextlib.contextmanager
def _run_lock(exclusive: bool):
    """A readers-writer lock over this run's xdist workers: a test takes it shared, an ``exclusive``
    one alone. A waiting writer first takes the gate, so tests that start later wait behind it."""
    run_dir = os.environ.get(RUN_DIR)
    if not run_dir or "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing runs beside it
        yield
        return
    gate = os.open(os.path.join(run_dir, "gate.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    tests = os.open(os.path.join(run_dir, "tests.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(tests, fcntl.LOCK_EX)  # the gate held meanwhile: no new test starts
            fcntl.flock(gate, fcntl.LOCK_UN)
        else:
            fcntl.flock(tests, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(tests)
        os.close(gate)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # setup, call and teardown: module and session fixtures start and end inside the lock too
    with _run_lock(item.get_closest_marker("exclusive") is not None):
        return (yield)


# Tests that share a session fixture costly to make twice, or that a second worker would rebuild
# under them: one VM engine with its booted snapshots and the image cache (tests/vm/conftest.py);
# the lab wheel and venv under build/lab (tests/lab/conftest.py).
SHARED = {"vm": "tests/vm/", "lab": "tests/lab/"}


def group_of(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return next((group for group, where in SHARED.items() if path.startswith(where)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n (or --dist load): a worker takes a whole group at a time, in the order of the collection."""
    if config.getoption("dist") != "load":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # not largest first: pytest_collection_modifyitems' order
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the order groups start in: those with an exclusive test, which comes first in its
    group (at the start, what it waits for is short; later it could be a test of minutes), the
    shared groups, the groups with a test marked slow (none is left to run alone at the end), then
    the rest. (Every worker sorts alike: xdist requires the same order.)"""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    groups = {item: group_of(item.nodeid) for item in items}
    first: dict[str, int] = {}
    for n, item in enumerate(items):
        first.setdefault(groups[item], n)

    def having(marker: str) -> set[str]:
        return {groups[item] for item in items if item.get_closest_marker(marker)}

    exclusive, slow = having("exclusive"), having("slow")
    order = {item: n for n, item in enumerate(items)}
    items.sort(key=lambda item: (groups[item] not in exclusive, groups[item] not in SHARED,
                                 groups[item] not in slow, first[groups[item]],
                                 item.get_closest_marker("exclusive") is None, order[item]))
