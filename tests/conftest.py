"""Shared fixtures: short data dirs (Unix socket paths are limited to 107 bytes)."""

from __future__ import annotations

import os
import select
import shutil
import tempfile
import time

import pytest

# What one run of the suite shares between its tests and its xdist workers (tests/parallel.py)
pytest_plugins = ["tests.parallel"]


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
