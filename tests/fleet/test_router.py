"""``forkd router`` in front of two real ``forkd serve`` hosts (process engine), driven through the
unchanged SDK: placement by where the snapshot is, pinned calls, the session WebSocket, merged
lists, tree and events, and a spawn over a host's cap (host 0 takes at most ``CAP`` sandboxes)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import urllib.request

import pytest

from forkd_server.client import AsyncController, Controller, ControllerError
from forkd_server.streaming import Session

from ..serving import cleanup
from .fleet import Router, count_alike, fleet

CAP = 3


@pytest.fixture(scope="module")
def world():
    with fleet(2, host_args=[[f"--ForkdApp.max_sandboxes={CAP}"], []]) as (router, hosts):
        yield router, hosts


@pytest.fixture
def api(world):
    router, _ = world
    return Controller(router.url, router.token, timeout=120)


@pytest.fixture
def direct(world):
    _, hosts = world
    return [Controller(h.url, h.token, timeout=120) for h in hosts]


@pytest.fixture(autouse=True)
def clean(world):
    yield
    for host in world[1]:
        cleanup(host.url, host.token)


def test_spawn_lands_where_the_snapshot_is(world, api, direct):
    _, hosts = world
    direct[1].create_snapshot("only-on-1", setup="where = 'host 1'")
    kids = api.spawn_sandboxes("only-on-1", 2)
    assert {k["host"] for k in kids} == {hosts[1].url}
    assert {k["id"] for k in kids} <= {s["id"] for s in direct[1].list_sandboxes()}
    assert direct[0].list_sandboxes() == []
    assert api.eval_code(kids[0]["id"], "where")["result"] == "'host 1'"


def test_snapshot_created_through_the_router_is_pinned_to_its_host(world, api, direct):
    _, hosts = world
    made = api.create_snapshot("made-here", setup="v = 7")
    where = made["host"]
    index = [h.url for h in hosts].index(where)
    assert "made-here" in {s["tag"] for s in direct[index].list_snapshots()}
    assert "made-here" not in {s["tag"] for s in direct[1 - index].list_snapshots()}
    kid = api.spawn_sandboxes("made-here")[0]
    assert kid["host"] == where
    # a second create of the tag goes to the host that has it, which refuses it as a host does
    with pytest.raises(ControllerError) as err:
        api.create_snapshot("made-here", setup="v = 8")
    assert err.value.status == 400 and "already exists" in str(err.value)


def test_pinned_calls_reach_the_sandbox_host(world, api, direct):
    _, hosts = world
    direct[1].create_snapshot("pin", setup="import os")
    sid = api.spawn_sandboxes("pin")[0]["id"]
    assert api.exec_command(sid, ["sh", "-c", "echo $((6*7))"])["stdout"] == "42\n"
    api.write_file(sid, "/tmp/via-router.txt", b"through the router")
    assert direct[1].read_file(sid, "/tmp/via-router.txt") == b"through the router"
    assert api.read_file(sid, "/tmp/via-router.txt") == b"through the router"
    assert {e["name"] for e in api.list_files(sid, "/tmp")} >= {"via-router.txt"}
    api.remove_file(sid, "/tmp/via-router.txt")
    assert api.run_code(sid, "state = 'set in a run'")["exit_code"] == 0
    assert direct[1].eval_code(sid, "state")["result"] == "'set in a run'"
    assert api.ping_sandbox(sid).keys() == direct[1].ping_sandbox(sid).keys()
    assert api.get_sandbox(sid)["host"] == hosts[1].url
    api.update_sandbox(sid, labels={"team": "blue"})
    assert direct[1].get_sandbox(sid)["labels"]["team"] == "blue"
    assert api.freeze_sandbox(sid)["tier"] == "frozen" == direct[1].get_sandbox(sid)["tier"]
    assert api.wake_sandbox(sid)["wake"]["from"] == "frozen"
    with pytest.raises(ControllerError) as err:  # the host's own answer: a process cannot be stored
        api.store_sandbox(sid)
    assert err.value.status == 409
    api.kill_sandbox(sid)
    assert sid not in {s["id"] for s in direct[1].list_sandboxes()}
    with pytest.raises(ControllerError) as err:
        api.get_sandbox(sid)
    assert err.value.status == 404


def test_session_websocket_streams_through_the_router(world, api, direct):
    direct[1].create_snapshot("sess", setup="n = 1")
    sid = api.spawn_sandboxes("sess")[0]["id"]
    seen = []
    with Session(api, sid) as s:
        reply = s.execute("for i in range(3): print('line', i)\nn += 1", on_event=seen.append)
    assert reply["status"] == "ok"
    out = "".join(e.get("text", "") for e in seen if e.get("type") == "stream")
    assert out == "line 0\nline 1\nline 2\n"
    assert direct[1].eval_code(sid, "n")["result"] == "2"


def test_session_refusals_pass_through(world):
    router, _ = world
    import websocket

    with pytest.raises(websocket.WebSocketBadStatusException) as err:
        websocket.create_connection(f"ws://127.0.0.1:{router.port}/v1/sandboxes/sb-none/session",
                                    header=[f"Authorization: Bearer {router.token}"], timeout=30)
    assert err.value.status_code == 404
    with pytest.raises(websocket.WebSocketBadStatusException) as err:
        websocket.create_connection(f"ws://127.0.0.1:{router.port}/v1/sandboxes/sb-none/session", timeout=30)
    assert err.value.status_code == 401


def test_branch_on_a_host_pins_the_new_snapshot_there(world, api, direct):
    _, hosts = world
    direct[1].create_snapshot("trunk", setup="depth = 0")
    sid = api.spawn_sandboxes("trunk")[0]["id"]
    api.run_code(sid, "depth = 1")
    snap = api.branch_sandbox(sid, "trunk-1")
    assert snap["host"] == hosts[1].url
    grandkids = api.spawn_sandboxes("trunk-1", 2)
    assert {k["host"] for k in grandkids} == {hosts[1].url}
    assert api.eval_code(grandkids[0]["id"], "depth")["result"] == "1"


def test_a_fork_tree_stays_on_its_host(world, api, direct):
    _, hosts = world
    direct[1].create_snapshot("tree", setup="v = 1")
    source = api.spawn_sandboxes("tree")[0]["id"]
    api.run_code(source, "v = 2")
    made = api._request("POST", f"/v1/sandboxes/{source}/fork", {"count": 3})
    assert made["snapshot"]["host"] == hosts[1].url and {k["host"] for k in made["sandboxes"]} == {hosts[1].url}
    kids = [k["id"] for k in made["sandboxes"]]
    assert [api.eval_code(k, "v")["result"] for k in kids] == ["2"] * 3
    kept = api._request("POST", f"/v1/sandboxes/{kids[0]}/promote", {"tree_id": made["fork_tree_id"]})
    assert kept["winner"]["id"] == kids[0] and set(kept["killed"]) == set(kids[1:]), kept
    assert {s["id"] for s in api.list_sandboxes()} == {source, kids[0]}
    with pytest.raises(ControllerError) as gone:  # the host says why (as across hosts, below)
        api.get_sandbox(kids[1])
    assert gone.value.status == 404 and (f"sandbox {kids[1]} not found: it lost fork tree {made['fork_tree_id']} "
                                         f"to {kids[0]}, which was promoted") in str(gone.value), str(gone.value)


def test_a_promote_across_hosts_says_why_each_sibling_ended(world, api, direct):
    """A tree whose children span hosts is a VM fork's (test_fleet_vm.py, end to end); here its record
    is the one ``fork_across`` keeps in router.db, over children spawned through the router on both
    hosts with the tree's label, so the router's promote runs against two real hosts. A sibling it
    kills on another host says why, in the words a host's own promote uses."""
    router, hosts = world
    tree = "ft-" + os.urandom(5).hex()
    direct[0].create_snapshot("span-0", setup="v = 0")
    direct[1].create_snapshot("span-1", setup="v = 1")
    near = [k["id"] for k in api.spawn_sandboxes("span-0", 2, labels={"fork_tree_id": tree})]
    (far,) = [k["id"] for k in api.spawn_sandboxes("span-1", 1, labels={"fork_tree_id": tree})]
    members = {**dict.fromkeys(near, hosts[0].url), far: hosts[1].url}
    record = {"source": "sb-gone", "home": hosts[0].url, "snapshot_tag": "span-0", "user_tag": True, "owners": {},
              "members": members, "status": "open", "winner": None}
    db = sqlite3.connect(router.db, timeout=30)
    with db:
        db.execute("INSERT INTO pins(kind, key, host, record, pinned_at) VALUES ('fork_tree', ?, ?, ?, ?)",
                   (tree, hosts[0].url, json.dumps(record), time.time()))
    db.close()
    kept = api.promote_sandbox(far, tree)
    assert (kept["winner"]["id"], sorted(kept["killed"]), kept["failed"]) == (far, sorted(near), []), kept
    assert kept["winner"]["host"] == hosts[1].url
    for sid in near:
        for ctl in (api, direct[0]):  # through the router and on the host alike
            with pytest.raises(ControllerError) as gone:
                ctl.get_sandbox(sid)
            assert gone.value.status == 404 and (f"sandbox {sid} not found: it lost fork tree {tree} to {far}, "
                                                 f"which was promoted") in str(gone.value), str(gone.value)


def test_a_fork_over_its_hosts_cap_of_a_process_sandbox_is_refused_and_leaves_nothing(world, api, direct):
    _, hosts = world
    direct[0].create_snapshot("proc-tree", setup="v = 1")
    source = api.spawn_sandboxes("proc-tree")[0]["id"]  # 1 of host 0's 3: room for 2 children
    with pytest.raises(ControllerError) as err:
        api.fork_sandbox(source, CAP)
    said = str(err.value)
    assert err.value.status == 503, said
    assert f"sandbox {source} runs on the process engine" in said and "room for 2 of the 3 children" in said, said
    assert "host-local and never move" in said and 'engine "vm"' in said and "-n 2" in said, said
    assert [s["id"] for s in direct[0].list_sandboxes()] == [source] and direct[1].list_sandboxes() == []
    assert {s["tag"] for s in direct[0].list_snapshots()} == {"proc-tree"} and direct[1].list_snapshots() == []
    made = api.fork_sandbox(source, CAP - 1)  # what it has room for: on its host, as without a router
    assert {k["host"] for k in made["sandboxes"]} == {made["snapshot"]["host"]} == {hosts[0].url}
    assert [api.eval_code(k["id"], "v")["result"] for k in made["sandboxes"]] == ["1"] * (CAP - 1)


def test_merged_lists_and_tree_name_each_host(world, api, direct):
    router, hosts = world
    for i in (0, 1):
        direct[i].create_snapshot(f"t{i}", setup="pass")
    kids = {i: api.spawn_sandboxes(f"t{i}")[0]["id"] for i in (0, 1)}
    sandboxes = {s["id"]: s["host"] for s in api.list_sandboxes()}
    assert sandboxes == {kids[0]: hosts[0].url, kids[1]: hosts[1].url}
    snapshots = {s["tag"]: s["host"] for s in api.list_snapshots()}
    assert snapshots == {"t0": hosts[0].url, "t1": hosts[1].url}
    nodes = {n["id"]: n for n in api.tree()}
    assert nodes["t0"]["host"] == hosts[0].url and nodes["t1"]["host"] == hosts[1].url
    assert nodes[kids[1]]["host"] == hosts[1].url and nodes[kids[1]]["parent"] == "t1"
    # the CLI shows them
    import subprocess

    from ..serving import FORKD
    shown = subprocess.run([*FORKD, "ls", "--url", router.url, "--token", router.token], capture_output=True,
                           text=True, timeout=60, check=True, env={**os.environ, "COLUMNS": "250"}).stdout
    assert f"{kids[1]}" in shown and hosts[1].url in shown and "host" in shown
    # a tag both hosts hold is one node naming both
    direct[0].create_snapshot("both", setup="pass")
    direct[1].create_snapshot("both", setup="pass")
    both = [n for n in api.tree() if n["id"] == "both"]
    assert len(both) == 1 and sorted(both[0]["hosts"]) == sorted(h.url for h in hosts)


def test_events_of_every_host_in_one_stream(world, api, direct):
    _, hosts = world
    direct[0].create_snapshot("ev0", setup="pass")
    direct[1].create_snapshot("ev1", setup="pass")
    seen: list[dict] = []
    ready = threading.Event()

    def follow():
        with api.events(timeout=60) as stream:
            ready.set()
            for event in stream:
                if event.get("kind") == "sandbox" and event.get("action") == "created":
                    seen.append(event)
                if len(seen) == 2:
                    return

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    assert ready.wait(30)
    # made on each host directly: the router learns of them from the hosts' own streams
    a = direct[0].spawn_sandboxes("ev0")[0]["id"]
    b = direct[1].spawn_sandboxes("ev1")[0]["id"]
    t.join(60)
    assert {(e["id"], e["host"]) for e in seen} == {(a, hosts[0].url), (b, hosts[1].url)}
    assert len({e["seq"] for e in seen}) == 2
    # and calls about them find their host though the router placed neither
    assert api.eval_code(b, "1 + 1")["result"] == "2"


def test_unknown_ids_and_bad_input(world, api):
    router, _ = world
    for call in (lambda: api.get_sandbox("sb-00000000-ffff"), lambda: api.eval_code("sb-00000000-ffff", "1"),
                 lambda: api.spawn_sandboxes("no-such-snapshot"), lambda: api.snapshot_info("no-such")):
        with pytest.raises(ControllerError) as err:
            call()
        assert err.value.status == 404, err.value
    with pytest.raises(ControllerError) as err:
        api.get_sandbox("sb-x?y=1#z")
    assert err.value.status == 404
    for n in (0, 1001):  # what a host refuses, the router refuses alike (a host says it)
        with pytest.raises(ControllerError) as err:
            api.spawn_sandboxes("no-such-snapshot", n)
        assert err.value.status == 400 and "n must be" in str(err.value)
    req = urllib.request.Request(f"{router.url}/v1/sandboxes", data=b"{not json", method="POST",
                                 headers={"Authorization": f"Bearer {router.token}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and "invalid JSON" in err.value.read().decode()
    # nested past the JSON parser's limit: the host's 400, not the router's 500 (it parses as hosts do)
    deep = b'{"snapshot_tag": "x", "labels": ' + b'{"a": ' * 1100 + b"1" + b"}" * 1101
    req = urllib.request.Request(f"{router.url}/v1/sandboxes", data=deep, method="POST",
                                 headers={"Authorization": f"Bearer {router.token}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and "invalid JSON" in err.value.read().decode()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{router.url}/v1/sandboxes", timeout=30)
    assert err.value.code == 401
    # a router started without --register-token-file takes no registrations, and says how to
    req = urllib.request.Request(f"{router.url}/v1/fleet/register", data=b'{"url": "http://127.0.0.1:1"}',
                                 method="POST", headers={"Authorization": f"Bearer {router.token}",
                                                         "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 403 and "--register-token-file" in err.value.read().decode()


def test_process_snapshot_over_its_host_cap_is_refused_and_never_moves(world, api, direct):
    _, hosts = world
    direct[0].create_snapshot("local", setup="pass")
    with pytest.raises(ControllerError) as err:
        api.spawn_sandboxes("local", CAP + 2)
    assert err.value.status == 503
    assert "host-local" in str(err.value) and 'engine "vm"' in str(err.value) and hosts[0].url in str(err.value)
    assert direct[0].list_sandboxes() == [] and direct[1].list_sandboxes() == []
    assert len(api.spawn_sandboxes("local", CAP)) == CAP  # what fits is placed


def test_spawn_over_a_host_cap_spills_to_another_holder(world, api, direct):
    _, hosts = world
    for ctl in direct:  # the same tag on both hosts (each its own template)
        ctl.create_snapshot("twin", setup="pass")
    kids = api.spawn_sandboxes("twin", CAP + 4)
    by_host = {h.url: sum(k["host"] == h.url for k in kids) for h in hosts}
    assert by_host[hosts[0].url] <= CAP and sum(by_host.values()) == CAP + 4
    assert by_host[hosts[1].url] >= 4
    assert len({k["id"] for k in kids}) == CAP + 4


def test_the_async_sdk_through_the_router(world, direct):
    import asyncio

    router, hosts = world
    direct[0].create_snapshot("aio", setup="x = 5")

    async def go():
        async with AsyncController(router.url, router.token) as ctl:
            kids = await ctl.spawn_sandboxes("aio", 2)
            got = await asyncio.gather(*(ctl.eval_code(k["id"], "x * 2") for k in kids))
            for k in kids:
                await ctl.kill_sandbox(k["id"])
            return kids, got

    kids, got = asyncio.run(go())
    assert [g["result"] for g in got] == ["10", "10"] and {k["host"] for k in kids} == {hosts[0].url}


def test_ids_two_hosts_hand_out_alike_are_never_shared():
    """Hosts number sandboxes per host (``sb-<second>-<n>``), so two hosts counting alike (made so
    here) and spawning in the same second hand out the same ids; through the router every id names
    one sandbox."""
    from concurrent.futures import ThreadPoolExecutor

    with fleet(2) as (router, hosts):
        api = Controller(router.url, router.token, timeout=120)
        for i, h in enumerate(hosts):
            Controller(h.url, h.token).create_snapshot(f"n{i}", setup=f"me = {i}")
        count_alike(hosts)
        with ThreadPoolExecutor(2) as pool:
            made = [kid for _ in range(3) for kids in pool.map(lambda i: api.spawn_sandboxes(f"n{i}", 3), (0, 1))
                    for kid in kids]
        assert len({k["id"] for k in made}) == len(made) == 18
        for k in made:
            assert api.eval_code(k["id"], "me")["result"] == str([h.url for h in hosts].index(k["host"]))
        for k in made:
            api.kill_sandbox(k["id"])
        clashes = router.output().count("handed out ids in use elsewhere")
        print(f"id clashes spawned again: {clashes}")


def test_a_host_emptied_since_the_last_heartbeat_takes_the_spawn(world, tmp_path):
    """The router's figures are its last heartbeat's: a spawn they say does not fit is placed
    again on the hosts' figures read afresh (sandboxes may have ended since) before it is refused.
    A router of its own in front of the module's capped host 0 (the module's router stays apart)."""
    _, hosts = world
    workdir = str(tmp_path)
    (tmp_path / "token").write_text(hosts[0].token)  # the hosts' token, which Router reads there
    direct = Controller(hosts[0].url, hosts[0].token, timeout=120)
    direct.create_snapshot("fresh", setup="pass")
    full = direct.spawn_sandboxes("fresh", CAP)
    router = Router([hosts[0].url], workdir, "--heartbeat", "600", "--down-after", "1200")
    try:  # its first heartbeat saw the host full, and it sees nothing more for ten minutes
        router.wait(lambda h: h["hosts_up"] >= 1, "see the host up")
        for kid in full:
            direct.kill_sandbox(kid["id"])
        api = Controller(router.url, router.token, timeout=120)
        kids = api.spawn_sandboxes("fresh", CAP)
        assert len(kids) == CAP and {k["host"] for k in kids} == {hosts[0].url}
    finally:
        router.stop()
