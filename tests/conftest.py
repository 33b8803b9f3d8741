"""Shared fixtures: short data dirs (Unix socket paths are limited to 107 bytes)."""

from __future__ import annotations

import os
import select
import shutil
import tempfile
import time

import pytest


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


def environ_holds(pids: set[int], text: str) -> set[int]:
    """The processes among ``pids`` whose environment holds ``text`` (a path only one test's sandboxes
    have in theirs): a test's own, not other servers' sandboxes on a shared host."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if text.encode() in f.read():
                    out.add(pid)
        except OSError:
            pass
    return out


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
