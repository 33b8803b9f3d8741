"""What the router meets between its look at a host and the host's answer: a host that filled up
after the router read its room (a fork over the cap it then answers 503), and a router killed with
-9 in the middle of a fork across hosts (what the fork made is undone by the next router). The host
is reached through a forwarding stand-in (fleet.py), which acts at the moment a call reaches it."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import threading
import time

import pytest

from forkd_server.client import Controller, ControllerError
from forkd_server.fleet import pending

from .fleet import Router, fleet, forwarding, stand_in_host, wait_for

CAP = 3


def test_a_fork_its_host_refuses_over_a_stale_figure_is_refused_host_local_and_leaves_nothing():
    """The router read room for both children (1 of 3 held), then the host filled to 2 of 3 before
    the fork reached it: the host's 503 is not passed on as it is; a process-engine source is
    refused as host-local, with the room the host has now, and nothing of the fork is left."""
    with fleet(2, host_args=[[f"--ForkdApp.max_sandboxes={CAP}"], []], router=False) as (workdir, hosts):
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        filled: list[dict] = []

        def fill(method: str, path: str) -> None:
            if method == "POST" and path.endswith("/fork") and not filled:
                filled.extend(direct[0].spawn_sandboxes("stale", 1))  # not through the router

        with stand_in_host(forwarding(hosts[0].url, fill)) as near:
            router = Router([near, hosts[1].url], workdir)
            try:
                router.wait(lambda h: h["hosts_up"] >= 2, "see both hosts up")
                api = Controller(router.url, router.token, timeout=120)
                direct[0].create_snapshot("stale", setup="v = 1")
                source = api.spawn_sandboxes("stale")[0]
                assert source["host"] == near
                with pytest.raises(ControllerError) as err:
                    api.fork_sandbox(source["id"], 2)
                said = str(err.value)
                assert filled, "the fork never reached the host"
                assert err.value.status == 503, said
                assert f"sandbox {source['id']} runs on the process engine" in said, said
                assert "room for 1 of the 2 children" in said and "host-local and never move" in said, said
                assert sorted(s["id"] for s in direct[0].list_sandboxes()) == sorted([source["id"], filled[0]["id"]])
                assert {s["tag"] for s in direct[0].list_snapshots()} == {"stale"}
                assert direct[1].list_sandboxes() == [] and direct[1].list_snapshots() == []
            finally:
                router.stop()


def _pending(router: Router) -> dict[str, dict]:
    """The router's pending forks (forkd_server/fleet/pending.py), read from its state file."""
    db = sqlite3.connect(router.db, timeout=30)
    try:
        rows = db.execute("SELECT key, record FROM pins WHERE kind='pending_fork'").fetchall()
    finally:
        db.close()
    return {key: json.loads(record) for key, record in rows}


def _plant(router: Router, tree: str, row: dict) -> None:
    db = sqlite3.connect(router.db, timeout=30)
    with db:
        db.execute("INSERT INTO pins(kind, key, host, record, pinned_at) VALUES ('pending_fork', ?, ?, ?, ?)",
                   (tree, row["home"], json.dumps(row), time.time()))
    db.close()


def _gone_saying(ctl: Controller, sid: str, why: str) -> None:
    with pytest.raises(ControllerError) as gone:
        ctl.get_sandbox(sid)
    assert gone.value.status == 404 and f"sandbox {sid} not found: {why}" in str(gone.value), str(gone.value)


def test_a_fork_a_dead_router_left_is_settled_and_a_live_ones_is_not():
    """What a fork across hosts leaves when its router dies mid-way, as pending.py records it: its
    branch (tagged with the tree's id) on its home host and children labelled with the tree on both
    hosts. The router settles the row of a process that is gone (its children killed on each host,
    each saying why, its branch released) and leaves alone the row of a process that runs (another
    router's fork in flight) and every sandbox no fork left."""
    with fleet(2) as (router, hosts):
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        dead, alive = ("ft-" + os.urandom(5).hex() for _ in range(2))
        direct[0].create_snapshot(dead, setup="v = 1")  # the branch the fork made
        direct[1].create_snapshot("elsewhere", setup="v = 2")
        left = [k["id"] for k in direct[0].spawn_sandboxes(dead, 2, labels={"fork_tree_id": dead})]
        left += [k["id"] for k in direct[1].spawn_sandboxes("elsewhere", 1, labels={"fork_tree_id": dead})]
        theirs = direct[1].spawn_sandboxes("elsewhere", 1, labels={"fork_tree_id": alive})[0]["id"]
        bystander = direct[1].spawn_sandboxes("elsewhere", 1)[0]["id"]
        _plant(router, alive, {"source": "sb-x", "home": hosts[1].url, "snapshot_tag": "elsewhere",
                               "user_tag": True, "router": pending.owner()})  # this process runs
        _plant(router, dead, {"source": "sb-x", "home": hosts[0].url, "snapshot_tag": dead, "user_tag": False,
                              "router": {"machine": socket.gethostname(), "pid": _ended_pid(), "started": 1}})
        wait_for(lambda: dead not in _pending(router), "the dead router's fork settled")
        api = Controller(router.url, router.token, timeout=120)
        for sid in left:
            _gone_saying(api, sid, f"it was a child of fork tree {dead}, which was never finished (its router stopped)")
        assert dead not in {s["tag"] for s in direct[0].list_snapshots()}
        assert {s["id"] for s in direct[1].list_sandboxes()} == {theirs, bystander}
        assert set(_pending(router)) == {alive}
        assert "was never finished (its router stopped): 3 children killed, its snapshot " \
               f"{dead} was released" in router.output()


def _ended_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_router_killed_mid_fork_leaves_nothing_once_started_again():
    """The router records a fork across hosts before it branches; killed with -9 while its host
    makes the branch, it leaves the row and, once the host is done, the branch. Started again on
    the same state file, it releases the branch and drops the row. A fork across hosts needs a VM
    source (test_fleet_vm.py): here the stand-in says the process source's engine is "vm", so the
    router forks it across hosts, and holds the branch until the router is dead."""
    with fleet(2, host_args=[[f"--ForkdApp.max_sandboxes={CAP}"], []], router=False) as (workdir, hosts):
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        source: dict = {}
        branching, go = threading.Event(), threading.Event()

        def hold(method: str, path: str) -> None:
            if method == "POST" and path.endswith("/branch") and not branching.is_set():
                branching.set()
                go.wait(120)

        def as_vm(method: str, path: str, body: bytes) -> bytes:
            if method == "GET" and source and path == f"/v1/sandboxes/{source['id']}":
                return json.dumps({**json.loads(body), "engine": "vm"}).encode()
            return body

        with stand_in_host(forwarding(hosts[0].url, hold, as_vm), release=go) as near:
            router = Router([near, hosts[1].url], workdir)
            try:
                router.wait(lambda h: h["hosts_up"] >= 2, "see both hosts up")
                api = Controller(router.url, router.token, timeout=120)
                direct[0].create_snapshot("mid", setup="v = 1")
                source.update(api.spawn_sandboxes("mid")[0])  # 1 of 3: room for 2 of the 3 children
                forking = threading.Thread(target=lambda: _quietly(api.fork_sandbox, source["id"], CAP), daemon=True)
                forking.start()
                assert branching.wait(60), "the fork never branched"
                (tree,) = _pending(router)
                assert _pending(router)[tree]["snapshot_tag"] == tree  # recorded before anything was made
                router.stop(kill=True)
                go.set()  # the host makes the branch now, for a router that is gone
                wait_for(lambda: tree in {s["tag"] for s in direct[0].list_snapshots()}, "the branch made")
                router.start()
                wait_for(lambda: not _pending(router), "the unfinished fork settled")
                assert {s["tag"] for s in direct[0].list_snapshots()} == {"mid"}
                assert [s["id"] for s in direct[0].list_sandboxes()] == [source["id"]]
                assert direct[1].list_sandboxes() == [] and direct[1].list_snapshots() == []
                forking.join(60)
            finally:
                router.stop()


def _quietly(call, *args) -> None:
    """A call whose answer never comes (its router is killed): the error is the expected end."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001
        pass
