"""Many live sandboxes on one server: past 1,024 descriptors, where select() stops working."""

from __future__ import annotations

import os

import pytest

from forkd_server.controller import Controller

from ..conftest import cleanup, requires_root, wait_gone

pytestmark = [requires_root, pytest.mark.slow]


def test_1100_live_sandboxes_are_listed_and_all_deleted(short_dir):
    c = Controller(short_dir)
    pids = set()
    try:
        c.create_snapshot("many", setup="x = 1")
        pids.add(c.registry.get_snapshot("many")["handle"]["pid"])
        kids = c.spawn("many", 1000) + c.spawn("many", 100)
        pids |= {k["pid"] for k in kids}
        ids = [k["id"] for k in kids]
        assert len(set(ids)) == 1100
        assert {s["id"] for s in c.list_sandboxes()} == set(ids)  # one pidfd per sandbox held from here
        assert max(int(fd) for fd in os.listdir("/proc/self/fd")) > 1024  # the case select() could not watch
        assert c.ping(ids[-1])["pong"] is True
        for sid in ids:
            c.kill_sandbox(sid)
        assert c.list_sandboxes() == []
        c.delete_snapshot("many")
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(pids) == set()
