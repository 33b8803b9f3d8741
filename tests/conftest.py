"""Shared fixtures: short data dirs (Unix socket paths are limited to 107 bytes); what one run of
the suite shares between its tests and its xdist workers (the VM engine's image cache; a lock that
lets a test marked ``exclusive`` run while no other test of the run does)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import tempfile
import time

import pytest

RUN_DIR = "FORKD_TEST_RUN_DIR"  # this run's own directory, made by the process that starts the run


@pytest.hookimpl(tryfirst=True)  # before xdist makes plain -n mean --dist load
def pytest_cmdline_main(config):
    # -n without --dist: the groups below (modules, and tests sharing a costly session fixture)
    if config.getoption("numprocesses", None) and config.getoption("dist", "no") == "no":
        config.option.dist = "loadgroup"
    if config.getoption("dist", "no") == "loadgroup":
        config.option.loadscopereorder = False  # the order of pytest_collection_modifyitems, not by size


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["forkd_dist"] = node.config.option.dist  # workers parse the command line alone


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: its controller made the run's directory
        if config.workerinput.get("forkd_dist") == "loadgroup":
            config.option.loadgroup = True  # xdist's own flag: the groups go into the node ids
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


# Under xdist (--dist loadgroup) a worker takes a whole group at a time: by default a module, so
# module fixtures (a server, a controller, a snapshot) start once; tests sharing a session fixture
# that is costly to make twice, or that a second worker would rebuild under them, form one group.
SHARED = {
    "vm": ("vm_engine",),                           # one VM engine with its booted snapshots (tests/vm)
    "lab": ("lab_wheel", "lab_venv", "lab_server"),  # the wheel and venv under build/lab (tests/lab)
}


def _group(item) -> str:
    for group, fixtures in SHARED.items():
        if any(f in item.fixturenames for f in fixtures):
            return group
    return item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    groups = {item: _group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # The shared groups (the longest), then those with a test marked slow, start first: none is left
    # to run alone at the end. (Every worker sorts alike: xdist requires the same order from each.)
    slow = {groups[item] for item in items if item.get_closest_marker("slow")}
    order = {item: n for n, item in enumerate(items)}
    items.sort(key=lambda item: (groups[item] not in SHARED, groups[item] not in slow, order[item]))


def cleanup(ctl) -> None:
    """Delete what an in-process Controller made: workspaces, sandboxes, snapshots."""
    for ws in ctl.list_workspaces():  # first: a workspace's state snapshot refuses a plain delete
        ctl.delete_workspace(ws["name"])
    for sb in ctl.list_sandboxes():
        ctl.kill_sandbox(sb["id"])
    for snap in ctl.list_snapshots():
        ctl.delete_snapshot(snap["tag"])


def completed(ask, expected: set[str], timeout: float = 30) -> list[str]:
    """``ask()`` for completions again, as a user pressing tab again would, until they hold
    ``expected``: the server's tags and ids are read in the background (a completion waits at most
    a moment for them). Returns the last answer, whatever it is, once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        found = ask()
        if expected <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture
def short_dir():
    path = tempfile.mkdtemp(prefix="fkt")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def nobody_processes() -> set[int]:
    """Host pids running as the sandbox uid (65534): every template, sandbox and reaper."""
    pids = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if line.split()[1] == "65534":
                                pids.add(int(name))
                            break
            except OSError:
                pass
    return pids


def engine_processes(data_dir: str) -> set[int]:
    """Host pids in the cgroup leaves of the process engine of the controller on ``data_dir``:
    every template, sandbox and init it made, and nothing of other servers or test runs on this
    host (their leaves are in groups of their own), so it can be compared before and after."""
    from forkd_engine.cgroups import locate, subtree

    where = locate("memory")
    if where is None:
        return nobody_processes()
    group = os.path.join(where[1], subtree("forkd", os.path.join(data_dir, "process")))
    pids: set[int] = set()
    for path, _dirs, files in os.walk(group):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids.update(int(p) for p in f.read().split())
            except OSError:  # removed as we looked
                pass
    return pids


requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="the process engine needs root")


def wait_gone(pids: set[int], timeout: float = 20) -> set[int]:
    """Wait (on pidfds, no polling sleep) until these processes exit; return the survivors."""
    deadline = time.monotonic() + timeout
    left = set(pids)
    for pid in list(left):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            left.discard(pid)
            continue
        try:
            poller = select.poll()  # not select(): a test may hold descriptors past 1024
            poller.register(fd, select.POLLIN)
            if poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                left.discard(pid)
        finally:
            os.close(fd)
    return {p for p in left if os.path.exists(f"/proc/{p}")}
