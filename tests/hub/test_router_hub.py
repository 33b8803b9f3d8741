"""The fleet's router as a JupyterHub-managed service: a real Hub (DummyAuthenticator,
configurable-http-proxy) runs ``forkd router --hub`` from docs/deploy/jupyterhub.md's lines, in front
of two real ``forkd serve`` hosts (process engine, the hosts' token only the router holds); users
alice and bob and the admin boss call it through the Hub's proxy at /services/forkd/ with Hub tokens.

Each host holds one of boss's snapshots (``base-0`` on host 0, ``base-1`` on host 1), made on the
host itself and shared through the router, so users' sandboxes land on both hosts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from unittest import mock

import pytest

from forkd_server.client import Controller, ControllerError

from ..fleet.fleet import fleet
from ..rest import exchange
from .hubrun import (
    ROUTER_SECTION,
    Hub,
    check_workspaces_are_their_makers,
    documented_config,
    needs_proxy,
    raw,
    server_environment,
)

# Ports only (free ones), no host-wide resource; slow: two hosts, a Hub, its proxy and the router start.
pytestmark = [pytest.mark.slow, needs_proxy]
BASES = ("base-0", "base-1")  # boss's, one on each host, shared
SHARED = "boss-shared"        # boss's, made through the router, shared


@pytest.fixture(scope="module")
def world():
    pytest.importorskip("jupyterhub")
    with fleet(2, router=False) as (workdir, hosts):
        for i, host in enumerate(hosts):  # made on each host, as an operator would: boss's by its label
            Controller(host.url, host.token).create_snapshot(BASES[i], setup=f"x = 41; where = {i}",
                                                             labels={"forkd.owner": "boss"})
        hub = Hub(["router", "--hub", "--hosts", ",".join(h.url for h in hosts),
                   "--hosts-token-file", os.path.join(workdir, "token"), "--data-dir", os.path.join(workdir, "r"),
                   "--heartbeat", "0.3", "--down-after", "3"], heading=ROUTER_SECTION)
        try:
            hub.wait_ready()
            wait_hosts_up(hub, 2)
            status, body = hub.api("POST", "/users", {"usernames": ["alice", "bob"]})
            assert status == 201, (status, body)
            hub.tokens = {name: hub.user_token(name) for name in ("alice", "bob", "boss")}
            boss = hub.ctl("boss")
            for tag in BASES:
                assert boss.share_snapshot(tag)["labels"]["forkd.shared"] == "true"
            made = boss.create_snapshot(SHARED, setup="x = 41")
            assert made["labels"]["forkd.owner"] == "boss"
            boss.share_snapshot(SHARED)
            yield hub, hosts
        finally:
            hub.stop()


@pytest.fixture(autouse=True)
def clean(world):
    yield
    hub, _ = world
    operator = Controller(hub.forkd_url, hub.operator_token)
    for sb in operator.list_sandboxes():
        operator.kill_sandbox(sb["id"])


def wait_hosts_up(hub, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status, health = exchange(f"{hub.forkd_url}/healthz")
        if status == 200 and health.get("hosts_up") == n:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the router did not see {n} hosts up within {timeout} s: {health}\n{hub.output()}")
        time.sleep(0.1)


def spawn(hub, who: str, tag: str) -> dict:
    return hub.ctl(who).spawn_sandboxes(tag, 1)[0]


def test_the_hub_runs_the_documented_router_config(world):
    hub, _ = world
    text = documented_config(ROUTER_SECTION)
    assert '"forkd", "router", "--hub"' in text and 'extra_user_scopes = {"access:services!service=forkd"}' in text
    with open(hub.config) as f:
        assert text in f.read()


def test_a_request_without_a_valid_hub_token_is_refused(world):
    hub, _ = world
    status, body = raw(hub, None, "GET", "/v1/sandboxes")
    assert status == 401 and body == {"error": "missing bearer token"}
    status, body = raw(hub, None, "GET", "/v1/sandboxes", token="not-a-token-of-this-hub-0123456789")
    assert status == 401 and body == {"error": "invalid bearer token"}
    status, made = hub.api("POST", "/users/alice/tokens", {"scopes": ["read:users:name!user=alice"]})
    assert status == 201, made
    status, body = raw(hub, None, "GET", "/v1/sandboxes", token=made["token"])
    assert status == 403 and "access:services!service=forkd" in body["error"], body
    assert exchange(f"{hub.forkd_url}/healthz")[1]["router"] is True  # health needs no token


def test_alices_list_never_shows_bobs_sandboxes_on_any_host(world):
    hub, hosts = world
    mine = [spawn(hub, "alice", "base-0"), spawn(hub, "alice", "base-1")]
    theirs = [spawn(hub, "bob", "base-0"), spawn(hub, "bob", "base-1")]
    assert {k["host"] for k in mine} == {h.url for h in hosts}  # one on each host
    alice = hub.ctl("alice")
    listed = {s["id"]: s for s in alice.list_sandboxes()}
    assert set(listed) == {k["id"] for k in mine}
    assert all(s["labels"]["forkd.owner"] == "alice" and "forkd.shared" not in s["labels"] for s in listed.values())
    assert alice.list_sandboxes(labels={"forkd.owner": "bob"}) == []
    nodes = {n["id"] for n in alice.tree()}
    assert {k["id"] for k in mine} <= nodes and set(BASES) <= nodes and not nodes & {k["id"] for k in theirs}
    bob = {s["id"] for s in hub.ctl("bob").list_sandboxes()}
    assert bob == {k["id"] for k in theirs}
    # an admin sees every user's, on every host
    assert {k["id"] for k in mine + theirs} <= {s["id"] for s in hub.ctl("boss").list_sandboxes()}


def test_alices_server_finds_the_router_with_no_setup(world):
    """The spawner gives alice's single-user server FORKD_URL (the router's service URL) and
    FORKD_TOKEN (its own Hub token); %forkd ls with that environment alone lists hers, not bob's."""
    hub, _ = world
    mine = [spawn(hub, "alice", "base-0")["id"], spawn(hub, "alice", "base-1")["id"]]
    theirs = [spawn(hub, "bob", "base-0")["id"], spawn(hub, "bob", "base-1")["id"]]
    try:
        hub.start_server("alice")
        env = server_environment(hub, "alice")
        assert env["FORKD_URL"] == hub.forkd_url and env["FORKD_TOKEN"] == env["JUPYTERHUB_API_TOKEN"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "JUPYTERHUB_"))}
        out = subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--colors=NoColor", "-c",
                              "%load_ext forkd_magics\n%forkd ls --everyone"],
                             env={**clean, "FORKD_URL": env["FORKD_URL"], "FORKD_TOKEN": env["FORKD_TOKEN"],
                                  "IPYTHONDIR": os.path.join(hub.workdir, "ipython")},
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert all(k in out.stdout for k in mine) and not any(k in out.stdout for k in theirs), out.stdout
    finally:
        hub.api("DELETE", "/users/alice/server")


def test_alices_jupyter_server_shows_her_panel_the_fleet(world):
    """Her server's forkd extension (remote mode from the spawner's FORKD_URL and token) passes the
    panel's reads on to the router as her: her sandboxes on both hosts, each with its host, never bob's."""
    hub, hosts = world
    mine = [spawn(hub, "alice", "base-0"), spawn(hub, "alice", "base-1")]
    theirs = [spawn(hub, "bob", "base-0")["id"], spawn(hub, "bob", "base-1")["id"]]
    try:
        hub.start_server("alice")
        alice = {"Authorization": f"token {hub.tokens['alice']}"}
        status, tree = exchange(f"{hub.public}/user/alice/forkd/v1/tree?memory=true", "GET", None, alice)
        assert status == 200, tree
        nodes = {n["id"]: n for n in tree}
        assert {k["id"]: nodes[k["id"]]["host"] for k in mine} == {k["id"]: k["host"] for k in mine}
        assert {nodes[k["id"]]["host"] for k in mine} == {h.url for h in hosts}
        assert not set(theirs) & set(nodes)
        status, body = exchange(f"{hub.public}/user/alice/forkd/v1/sandboxes/{theirs[0]}", "GET", None, alice)
        assert status == 404, body
    finally:
        hub.api("DELETE", "/users/alice/server")


def test_bobs_token_gets_404_for_alices_sandbox(world):
    hub, _ = world
    mine = spawn(hub, "alice", "base-1")["id"]
    unknown = raw(hub, "bob", "GET", "/v1/sandboxes/sb-00000000-0000")
    assert unknown == (404, {"error": "sandbox sb-00000000-0000 not found on any host of the fleet"})
    for method, path, body in (("GET", f"/v1/sandboxes/{mine}", None),
                               ("POST", f"/v1/sandboxes/{mine}/eval", {"code": "1"}),
                               ("POST", f"/v1/sandboxes/{mine}/exec", {"command": ["true"]}),
                               ("GET", f"/v1/sandboxes/{mine}/files?path=/tmp", None),
                               ("POST", f"/v1/sandboxes/{mine}/branch", {"tag": "bob-steals"}),
                               ("POST", f"/v1/sandboxes/{mine}/fork", {"count": 1}),
                               ("PATCH", f"/v1/sandboxes/{mine}", {"labels": {"team": "bob"}}),
                               ("DELETE", f"/v1/sandboxes/{mine}", None)):
        status, answer = raw(hub, "bob", method, path, body)
        assert (status, answer) == (404, {"error": f"sandbox {mine} not found on any host of the fleet"}), \
            (method, path, status, answer)
    with pytest.raises(ControllerError) as refused:  # the session WebSocket, through the proxy
        hub.ctl("bob").session(mine)
    assert refused.value.status == 404
    alice = hub.ctl("alice")
    assert alice.eval_code(mine, "x + 1")["result"] == "42"  # still there, and hers
    with alice.session(mine) as session:
        assert session.request("execute", code="y = x + 1")["status"] == "ok"
    alice.kill_sandbox(mine)
    status, answer = raw(hub, "alice", "GET", f"/v1/sandboxes/{mine}")  # its owner hears how it ended
    assert status == 404 and answer.get("ended"), answer
    assert raw(hub, "bob", "GET", f"/v1/sandboxes/{mine}") == \
        (404, {"error": f"sandbox {mine} not found on any host of the fleet"})


def test_both_spawn_from_an_admins_shared_snapshot_and_neither_may_change_it(world):
    hub, _ = world
    for who in ("alice", "bob"):
        ctl = hub.ctl(who)
        assert {SHARED, *BASES} <= {s["tag"] for s in ctl.list_snapshots()}
        kid = spawn(hub, who, SHARED)
        assert kid["labels"]["forkd.owner"] == who and "forkd.shared" not in kid["labels"]
        assert ctl.eval_code(kid["id"], "x + 1")["result"] == "42"
        for method, path in (("DELETE", f"/v1/snapshots/{SHARED}"), ("POST", f"/v1/snapshots/{SHARED}/push")):
            status, body = raw(hub, who, method, path)
            assert status == 403 and "only admins" in body["error"], (method, path, status, body)
        for method in ("POST", "DELETE"):
            status, body = raw(hub, who, method, f"/v1/snapshots/{SHARED}/share")
            assert status == 403 and "only admins" in body["error"], body
    # boss's snapshot that is not shared is as private as anyone's
    kid = spawn(hub, "boss", "base-0")["id"]
    hub.ctl("boss").branch_sandbox(kid, "boss-private")
    for method, path, body in (("POST", "/v1/sandboxes", {"snapshot_tag": "boss-private"}),
                               ("GET", "/v1/snapshots/boss-private/info", None),
                               ("DELETE", "/v1/snapshots/boss-private", None)):
        assert raw(hub, "alice", method, path, body) == \
            (404, {"error": "snapshot boss-private not found on any host of the fleet"}), (method, path)
    assert "boss-private" not in {s["tag"] for s in hub.ctl("alice").list_snapshots()}
    hub.ctl("boss").unshare_snapshot(SHARED)  # taken back: gone from the users' view
    assert SHARED not in {s["tag"] for s in hub.ctl("alice").list_snapshots()}
    assert raw(hub, "alice", "POST", "/v1/sandboxes", {"snapshot_tag": SHARED})[0] == 404
    hub.ctl("boss").share_snapshot(SHARED)
    hub.ctl("boss").delete_snapshot("boss-private")


def test_the_owner_label_cannot_be_overridden(world):
    hub, _ = world
    for labels in ({"forkd.owner": "bob"}, {"forkd.shared": "true"}):
        status, body = raw(hub, "alice", "POST", "/v1/sandboxes", {"snapshot_tag": "base-0", "labels": labels})
        assert status == 403 and next(iter(labels)) in body["error"], body
        status, body = raw(hub, "alice", "POST", "/v1/snapshots", {"tag": "alice-fake", "labels": labels})
        assert status == 403, body
    assert raw(hub, "boss", "GET", "/v1/snapshots/alice-fake/info")[0] == 404  # nothing was made
    kid = hub.ctl("alice").spawn_sandboxes("base-0", 1, labels={"team": "red"})[0]["id"]
    alice = hub.ctl("alice")
    assert alice.get_sandbox(kid)["labels"] == {"team": "red", "forkd.owner": "alice"}
    for path, body in ((f"/v1/sandboxes/{kid}", {"labels": {"forkd.owner": "bob"}}),
                       (f"/v1/sandboxes/{kid}", {"remove_labels": ["forkd.owner"]})):
        assert raw(hub, "alice", "PATCH", path, body)[0] == 403
    status, body = raw(hub, "alice", "POST", f"/v1/sandboxes/{kid}/branch",
                       {"tag": "alice-b", "labels": {"forkd.owner": "bob"}})
    assert status == 403, body
    # what alice makes from her sandbox is hers, on its host: a branch, a fork tree's snapshot and children
    snap = alice.branch_sandbox(kid, "alice-b")
    assert snap["labels"]["forkd.owner"] == "alice"
    tree = alice.fork_sandbox(kid, 2)
    assert tree["snapshot"]["labels"]["forkd.owner"] == "alice"
    assert all(alice.get_sandbox(k["id"])["labels"]["forkd.owner"] == "alice" for k in tree["sandboxes"])
    assert "alice-b" not in {s["tag"] for s in hub.ctl("bob").list_snapshots()}
    assert raw(hub, "bob", "GET", "/v1/snapshots/alice-b/info")[0] == 404
    for sb in tree["sandboxes"]:
        alice.kill_sandbox(sb["id"])
    alice.kill_sandbox(kid)
    for tag in ("alice-b", tree["snapshot"]["tag"]):
        alice.delete_snapshot(tag)


def test_events_carry_only_the_users_own_changes(world):
    hub, _ = world
    alice, bob = hub.ctl("alice"), hub.ctl("bob")
    stream = alice.events(timeout=60)
    try:
        theirs = spawn(hub, "bob", "base-1")["id"]  # before alice's: the stream would carry it first
        bob.kill_sandbox(theirs)
        mine = spawn(hub, "alice", "base-1")["id"]
        alice.kill_sandbox(mine)
        seen = []
        for event in stream:
            seen.append(event)
            if event.get("kind") == "sandbox" and event.get("id") == mine and event.get("action") == "killed":
                break
    finally:
        stream.close()
    assert not [e for e in seen if e.get("id") == theirs or e.get("kind") == "host"], seen
    assert [e["action"] for e in seen if e.get("id") == mine] == ["created", "killed"], seen


def test_admin_routes_and_the_operator(world):
    hub, _ = world
    for method, path, body in (("GET", "/v1/fleet/hosts", None), ("GET", "/metrics", None),
                               ("POST", "/v1/snapshots/pull", {"tag": "base-0"}),
                               ("DELETE", "/v1/store/snapshots/base-0", None)):
        status, answer = raw(hub, "alice", method, path, body)
        assert status == 403 and "admins" in answer["error"], (path, status, answer)
    assert raw(hub, "boss", "GET", "/v1/fleet/hosts")[0] == 200
    # the path of pulls is also that of a snapshot tagged "pull": deleting it is its owner's, as any
    assert raw(hub, "alice", "DELETE", "/v1/snapshots/pull") == \
        (404, {"error": "snapshot pull not found on any host of the fleet"})
    mine = spawn(hub, "alice", "base-0")["id"]
    operator = Controller(hub.forkd_url, hub.operator_token)
    assert mine in {s["id"] for s in operator.list_sandboxes()}
    assert raw(hub, "alice", "GET", "/v1/nothing-here")[0] == 404
    assert raw(hub, "alice", "GET", "/version")[1]["router"] is True


def test_workspaces_and_copies_are_their_makers(world):
    hub, _ = world
    alice, bob = hub.ctl("alice"), hub.ctl("bob")
    status, body = raw(hub, "alice", "POST", "/v1/workspaces",
                       {"name": "alice-ws", "snapshot_tag": "base-1", "labels": {"forkd.owner": "bob"}})
    assert status == 403 and "forkd.owner" in body["error"], body
    check_workspaces_are_their_makers(hub, "base-1", "workspace alice-ws not found on any host of the fleet")
    # a copy of a shared snapshot is its maker's, and not shared
    copy = alice.compact_snapshot(SHARED, "alice-copy")
    try:
        assert copy["labels"]["forkd.owner"] == "alice" and "forkd.shared" not in copy["labels"]
        assert "alice-copy" not in {s["tag"] for s in bob.list_snapshots()}
        assert raw(hub, "bob", "POST", "/v1/snapshots/alice-copy/compact", {"to": "bob-copy"})[0] == 404
    finally:
        alice.delete_snapshot("alice-copy")


def test_a_kernels_record_is_its_heads_owners(world):
    hub, _ = world
    alice, bob = hub.ctl("alice"), hub.ctl("bob")
    mine, theirs = spawn(hub, "alice", "base-0")["id"], spawn(hub, "bob", "base-1")["id"]
    unknown = (404, {"error": "kernel k-alice not found on any host of the fleet"})
    alice.set_kernel_head("k-alice", mine, notebook="alice.ipynb")
    assert "k-alice" in {k["kernel_id"] for k in alice.list_kernels()}
    assert "k-alice" not in {k["kernel_id"] for k in bob.list_kernels()}
    assert raw(hub, "bob", "GET", "/v1/kernels/k-alice") == unknown
    # bob can neither take alice's record over nor point his kernel at her sandbox
    assert raw(hub, "bob", "PUT", "/v1/kernels/k-alice", {"head": theirs}) == unknown
    assert raw(hub, "bob", "PUT", "/v1/kernels/k-bob", {"head": mine})[0] == 404
    assert raw(hub, "bob", "POST", "/v1/kernels/k-alice/checkout", {"sandbox": theirs}) == unknown
    assert raw(hub, "bob", "DELETE", "/v1/kernels/k-alice") == unknown
    assert alice.get_kernel("k-alice")["head"] == mine
    alice.kill_sandbox(mine)  # a restarted kernel still finds where it was; bob still does not
    assert alice.get_kernel("k-alice")["head"] == mine
    assert "k-alice" in {k["kernel_id"] for k in alice.list_kernels()}
    assert raw(hub, "bob", "GET", "/v1/kernels/k-alice") == unknown
    alice.forget_kernel("k-alice")


def test_an_owner_an_admin_changes_holds_at_once_for_calls(world):
    """The router decides calls by the labels it keeps; a host's ``updated`` event carries new ones,
    so an admin's hand-over of a sandbox holds at once for the old and the new owner."""
    hub, _ = world
    sid = spawn(hub, "alice", "base-0")["id"]
    assert hub.ctl("alice").ping_sandbox(sid)  # her labels are kept by the router now
    status, body = raw(hub, "boss", "PATCH", f"/v1/sandboxes/{sid}", {"labels": {"forkd.owner": "bob"}})
    assert status == 200 and body["labels"]["forkd.owner"] == "bob", body
    deadline = time.monotonic() + 30
    while raw(hub, "bob", "POST", f"/v1/sandboxes/{sid}/ping")[0] != 200:
        assert time.monotonic() < deadline, "bob never got the sandboxes boss handed him"
        time.sleep(0.05)
    assert raw(hub, "alice", "POST", f"/v1/sandboxes/{sid}/ping")[0] == 404
    assert sid in {s["id"] for s in hub.ctl("bob").list_sandboxes()}


def test_alices_forkd_kernel_through_the_router(world):
    """The forkd kernel with alice's server's environment: its base snapshot, branch, fork and
    checkout go through the router as hers; its HEAD is recorded for her; bob sees none of it."""
    from jupyter_client.manager import start_new_kernel

    from ..kernel.cells import run

    hub, _ = world
    env = {"FORKD_URL": hub.forkd_url, "FORKD_TOKEN": hub.tokens["alice"], "JUPYTERHUB_USER": "alice"}
    with mock.patch.dict(os.environ, env):
        km, kc = start_new_kernel(kernel_name="forkd-python")
    try:
        assert run(kc, "x = 21").ok
        branch = run(kc, "%forkd branch --live")
        assert branch.ok and "status='ready'" in branch.result, branch.text
        assert run(kc, "kids = %forkd fork -n 2").ok
        assert run(kc, "%forkd checkout kids[1]").ok
        assert run(kc, "x + 1").result == "22"
        assert run(kc, "%forkd checkout -").ok
        tree = run(kc, "%forkd tree")
        assert tree.ok, tree.text
        alice, bob = hub.ctl("alice"), hub.ctl("bob")
        hers = {s["id"] for s in alice.list_sandboxes()}
        assert len(hers) >= 3 and all(s["labels"]["forkd.owner"] == "alice" for s in alice.list_sandboxes())
        assert not hers & {s["id"] for s in bob.list_sandboxes()}
        heads = {k["kernel_id"]: k["head"] for k in alice.list_kernels()}
        assert heads and set(heads.values()) <= hers
        assert not set(heads) & {k["kernel_id"] for k in bob.list_kernels()}
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=False)


def test_a_lost_sandbox_is_told_as_lost_to_its_owner_only(world):
    """Host 1's server killed with -9: alice's sandbox there is listed ``lost`` to her and answers her
    410; to bob it is not there (404, an unknown id's words). When the host is back, it answers again."""
    hub, hosts = world
    sid = spawn(hub, "alice", "base-1")["id"]
    hosts[1].crash()
    try:
        wait_hosts_up(hub, 1)
        lost = {s["id"]: s for s in hub.ctl("alice").list_sandboxes()}
        assert lost[sid]["status"] == "lost", lost
        assert sid not in {s["id"] for s in hub.ctl("bob").list_sandboxes()}
        status, body = raw(hub, "alice", "POST", f"/v1/sandboxes/{sid}/ping")
        assert status == 410 and body["lost"]["host"] == hosts[1].url, body
        status, body = raw(hub, "bob", "POST", f"/v1/sandboxes/{sid}/ping")
        assert status == 404 and body["error"].startswith(f"sandbox {sid} not found on any host of the fleet"), body
        assert sid not in {n["id"] for n in hub.ctl("bob").tree()}
    finally:
        hosts[1].start()
        hosts[1].wait_healthy()
        wait_hosts_up(hub, 2)
    assert hub.ctl("alice").ping_sandbox(sid)
