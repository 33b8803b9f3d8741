"""forkd serve as a JupyterHub-managed service: a real Hub (DummyAuthenticator, SimpleLocalProcessSpawner,
configurable-http-proxy), users alice and bob, the admin boss; every call goes through the Hub's proxy
at /services/forkd/ with a Hub token, as a user's notebook makes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from forkd_server.client import Controller, ControllerError

from ..rest import exchange
from .hubrun import (
    Hub,
    check_workspaces_are_their_makers,
    documented_config,
    needs_proxy,
    raw,
    server_environment,
)

# Ports only (free ones), no host-wide resource; slow: a Hub, its proxy, forkd and a user's server start
# (~10 s), so with -n the module starts early rather than last.
pytestmark = [pytest.mark.slow, needs_proxy]
BASE = "hub-base"


@pytest.fixture(scope="module")
def hub():
    pytest.importorskip("jupyterhub")
    hub = Hub()
    try:
        hub.wait_ready()
        status, body = hub.api("POST", "/users", {"usernames": ["alice", "bob"]})
        assert status == 201, (status, body)
        hub.tokens = {name: hub.user_token(name) for name in ("alice", "bob", "boss")}
        boss = hub.ctl("boss")
        boss.create_snapshot(BASE, setup="x = 41")
        assert boss.share_snapshot(BASE)["labels"]["forkd.shared"] == "true"
        yield hub
    finally:
        hub.stop()


def spawn(hub, who: str, tag: str = BASE) -> str:
    return hub.ctl(who).spawn_sandboxes(tag, 1)[0]["id"]


def test_the_hub_runs_the_documented_config(hub):
    """docs/deploy/jupyterhub.md's lines are what this Hub runs (hubrun.py only changes addresses)."""
    text = documented_config()
    assert 'c.JupyterHub.extra_user_scopes = {"access:services!service=forkd"}' in text
    assert '"FORKD_TOKEN": lambda spawner: spawner.api_token' in text
    with open(hub.config) as f:
        assert text in f.read()


def test_a_request_without_a_valid_hub_token_is_refused(hub):
    status, body = raw(hub, None, "GET", "/v1/sandboxes")
    assert status == 401 and "missing" in body["error"]
    status, body = raw(hub, None, "GET", "/v1/sandboxes", token="not-a-token-of-this-hub-0123456789")
    assert status == 401 and "invalid" in body["error"]
    # a real token of alice's, without the service's scope
    status, made = hub.api("POST", "/users/alice/tokens", {"scopes": ["read:users:name!user=alice"]})
    assert status == 201, made
    status, body = raw(hub, None, "GET", "/v1/sandboxes", token=made["token"])
    assert status == 403 and "access:services!service=forkd" in body["error"], body


def test_users_see_and_touch_only_their_own_sandboxes(hub):
    mine, theirs = spawn(hub, "alice"), spawn(hub, "bob")
    alice = hub.ctl("alice")
    listed = {s["id"]: s for s in alice.list_sandboxes()}
    assert mine in listed and theirs not in listed
    assert alice.list_sandboxes(labels={"forkd.owner": "bob"}) == []
    assert [s["id"] for s in alice.list_sandboxes(labels={"forkd.owner": "alice"})] == [mine]
    assert listed[mine]["labels"]["forkd.owner"] == "alice"
    assert "forkd.shared" not in listed[mine]["labels"]  # not inherited from the shared snapshot
    assert alice.eval_code(mine, "x + 1")["result"] == "42"
    with alice.session(mine) as session:  # the forkd kernel's WebSocket, through the proxy
        assert session.request("execute", code="y = x + 1")["status"] == "ok"
    with pytest.raises(ControllerError) as refused:
        hub.ctl("bob").session(mine)
    assert refused.value.status == 404 and refused.value.message == f"sandbox {mine} not found"
    # bob's sandbox answers alice as an unknown id would, on every route
    for method, path, body in (("GET", f"/v1/sandboxes/{theirs}", None),
                               ("POST", f"/v1/sandboxes/{theirs}/eval", {"code": "1"}),
                               ("POST", f"/v1/sandboxes/{theirs}/branch", {"tag": "alice-steals"}),
                               ("POST", f"/v1/sandboxes/{theirs}/freeze", None),
                               ("POST", f"/v1/sandboxes/{theirs}/wake", None),
                               ("DELETE", f"/v1/sandboxes/{theirs}", None)):
        status, answer = raw(hub, "alice", method, path, body)
        assert status == 404 and answer["error"] == f"sandbox {theirs} not found", (method, path, status, answer)
    assert raw(hub, "alice", "GET", "/v1/sandboxes/sb-00000000-0000")[0] == 404
    # the Hub's public name, not this host's: the Hub vouches for the caller, the Host header is no guard
    status, answer = raw(hub, "alice", "GET", "/v1/sandboxes", host="hub.example.org")
    assert status == 200 and mine in {s["id"] for s in answer}, (status, answer)
    nodes = {n["id"] for n in alice.tree()}
    assert mine in nodes and BASE in nodes and theirs not in nodes
    # the admin sees both; bob's sandbox is still there
    everyone = {s["id"] for s in hub.ctl("boss").list_sandboxes()}
    assert {mine, theirs} <= everyone
    hub.ctl("bob").kill_sandbox(theirs)
    alice.kill_sandbox(mine)
    # how it ended is told to its owner; to others it is an unknown id
    status, answer = raw(hub, "alice", "GET", f"/v1/sandboxes/{mine}")
    assert status == 404 and answer["error"] != f"sandbox {mine} not found", answer
    assert raw(hub, "bob", "GET", f"/v1/sandboxes/{mine}") == (404, {"error": f"sandbox {mine} not found"})


def test_shared_snapshot_is_spawnable_by_all_and_writable_by_admins_only(hub):
    for who in ("alice", "bob"):
        assert BASE in {s["tag"] for s in hub.ctl(who).list_snapshots()}
        kid = spawn(hub, who)
        hub.ctl(who).kill_sandbox(kid)
        status, body = raw(hub, who, "DELETE", f"/v1/snapshots/{BASE}")
        assert status == 403 and "only admins" in body["error"], body
        status, body = raw(hub, who, "DELETE", f"/v1/snapshots/{BASE}/share")
        assert status == 403, body
    assert hub.ctl("boss").snapshot_info(BASE)["labels"]["forkd.shared"] == "true"
    # taken back with the CLI, by the admin: gone from the users' view; shared again
    cli = [sys.executable, "-c", "import sys; from forkd_server.cli import main; sys.exit(main())"]
    for who, undo, code in (("alice", ["--undo"], 1), ("boss", ["--undo"], 0)):
        out = subprocess.run([*cli, "snapshot-share", BASE, *undo, "--url", hub.forkd_url, "--token", hub.tokens[who],
                              "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == code, (who, out.stdout, out.stderr)
    assert BASE not in {s["tag"] for s in hub.ctl("alice").list_snapshots()}
    assert raw(hub, "alice", "POST", "/v1/sandboxes", {"snapshot_tag": BASE})[0] == 404
    hub.ctl("boss").share_snapshot(BASE)
    assert BASE in {s["tag"] for s in hub.ctl("alice").list_snapshots()}


def test_branches_are_their_makers_and_private(hub):
    alice, bob, boss = hub.ctl("alice"), hub.ctl("bob"), hub.ctl("boss")
    kid = spawn(hub, "alice")
    try:
        snap = alice.branch_sandbox(kid, "alice-branch")
        assert snap["labels"].get("forkd.owner") == "alice" and "forkd.shared" not in snap["labels"]
        assert "alice-branch" in {s["tag"] for s in alice.list_snapshots()}
        assert "alice-branch" not in {s["tag"] for s in bob.list_snapshots()}
        assert "alice-branch" not in {n["id"] for n in bob.tree()}
        for method, path, body in (("GET", "/v1/snapshots/alice-branch/info", None),
                                   ("POST", "/v1/sandboxes", {"snapshot_tag": "alice-branch"}),
                                   ("DELETE", "/v1/snapshots/alice-branch", None)):
            status, answer = raw(hub, "bob", method, path, body)
            assert status == 404 and answer["error"] == "snapshot alice-branch not found", (method, status, answer)
        assert "alice-branch" in {s["tag"] for s in boss.list_snapshots()}
        # an admin's own snapshot, not shared, is as private as anyone's
        boss_kid = spawn(hub, "boss")
        boss.branch_sandbox(boss_kid, "boss-private")
        boss.kill_sandbox(boss_kid)
        assert raw(hub, "alice", "POST", "/v1/sandboxes", {"snapshot_tag": "boss-private"})[0] == 404
        boss.delete_snapshot("boss-private")
        # a fork tree: its branch and children are alice's; bob can neither fork nor promote hers
        tree = alice.fork_sandbox(kid, 2)
        kids = [k["id"] for k in tree["sandboxes"]]
        assert all(alice.get_sandbox(k)["labels"]["forkd.owner"] == "alice" for k in kids)
        assert tree["snapshot"]["labels"]["forkd.owner"] == "alice"
        for path in (f"/v1/sandboxes/{kid}/fork", f"/v1/sandboxes/{kids[0]}/promote"):
            status, answer = raw(hub, "bob", "POST", path, {"count": 1} if path.endswith("fork") else {})
            assert status == 404, (path, status, answer)
        promoted = alice.promote_sandbox(kids[0])
        assert kids[1] in promoted["killed"]
        alice.kill_sandbox(kids[0])
    finally:
        alice.kill_sandbox(kid)
    alice.delete_snapshot("alice-branch")


def test_the_owner_label_is_the_servers(hub):
    status, body = raw(hub, "alice", "POST", "/v1/sandboxes",
                       {"snapshot_tag": BASE, "labels": {"forkd.owner": "bob"}})
    assert status == 403 and "forkd.owner" in body["error"], body
    status, body = raw(hub, "alice", "POST", "/v1/sandboxes", {"snapshot_tag": BASE, "labels": {"forkd.shared": "true"}})
    assert status == 403, body
    kid = spawn(hub, "alice")
    try:
        status, body = raw(hub, "alice", "PATCH", f"/v1/sandboxes/{kid}", {"labels": {"forkd.owner": "bob"}})
        assert status == 403, body
        status, body = raw(hub, "alice", "PATCH", f"/v1/sandboxes/{kid}", {"remove_labels": ["forkd.owner"]})
        assert status == 403 and "forkd.owner" in body["error"], body  # nor taken off
        assert hub.ctl("alice").get_sandbox(kid)["labels"]["forkd.owner"] == "alice"
    finally:
        hub.ctl("alice").kill_sandbox(kid)


def test_events_carry_only_the_users_own_changes(hub):
    alice, bob = hub.ctl("alice"), hub.ctl("bob")
    stream = alice.events(timeout=60)
    try:
        theirs = spawn(hub, "bob")  # created before alice's: the stream would carry it first
        bob.kill_sandbox(theirs)
        mine = spawn(hub, "alice")
        alice.kill_sandbox(mine)  # its row is gone when the event is sent: the end still reaches alice
        seen = []
        for event in stream:
            seen.append(event)
            if event.get("kind") == "sandbox" and event.get("id") == mine and event.get("action") == "killed":
                break
    finally:
        stream.close()
    assert not [e for e in seen if e.get("id") == theirs], seen
    assert [e["action"] for e in seen if e.get("id") == mine] == ["created", "killed"], seen


def test_a_users_server_finds_forkd_with_no_setup(hub):
    """The spawner gives alice's server FORKD_URL and FORKD_TOKEN (its own Hub token); the SDK run
    with that environment alone sees alice's sandboxes and not bob's."""
    mine, theirs = spawn(hub, "alice"), spawn(hub, "bob")
    try:
        hub.start_server("alice")
        env = server_environment(hub, "alice")
        assert env["FORKD_URL"] == hub.forkd_url
        assert env["FORKD_TOKEN"] == env["JUPYTERHUB_API_TOKEN"]
        script = ("import json; from forkd_server.client import Controller; "
                  "print(json.dumps([s['id'] for s in Controller().list_sandboxes()]))")
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "JUPYTERHUB_"))}
        out = subprocess.run([sys.executable, "-c", script], env={**clean, "FORKD_URL": env["FORKD_URL"],
                                                                  "FORKD_TOKEN": env["FORKD_TOKEN"]},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        ids = json.loads(out.stdout)
        assert mine in ids and theirs not in ids
        # the magics, in an IPython with that environment alone: --everyone is everyone alice sees
        out = subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--colors=NoColor", "-c",
                              "%load_ext forkd_magics\n%forkd ls --everyone"],
                             env={**clean, "FORKD_URL": env["FORKD_URL"], "FORKD_TOKEN": env["FORKD_TOKEN"],
                                  "IPYTHONDIR": os.path.join(hub.workdir, "ipython")},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert mine in out.stdout and theirs not in out.stdout and BASE in out.stdout, out.stdout
    finally:
        hub.api("DELETE", "/users/alice/server")
        hub.ctl("alice").kill_sandbox(mine)
        hub.ctl("bob").kill_sandbox(theirs)


def test_a_users_jupyter_server_passes_her_panel_on_to_the_service(hub):
    """The forkd extension of alice's server (remote mode, from the spawner's FORKD_URL and its own
    token) shows through its own routes what the service shows her: her sandboxes, never bob's."""
    mine, theirs = spawn(hub, "alice"), spawn(hub, "bob")
    try:
        hub.start_server("alice")
        own = f"{hub.public}/user/alice/forkd"
        alice = {"Authorization": f"token {hub.tokens['alice']}"}
        status, listed = exchange(f"{own}/v1/sandboxes", "GET", None, alice)
        assert status == 200, listed
        assert mine in [s["id"] for s in listed] and theirs not in [s["id"] for s in listed]
        status, tree = exchange(f"{own}/v1/tree?memory=true", "GET", None, alice)
        assert status == 200 and mine in [n["id"] for n in tree] and theirs not in [n["id"] for n in tree]
        assert BASE in [n["id"] for n in tree]  # boss's shared snapshot, which she may spawn from
        # bob's id is an unknown one to her, through her server as through the service
        status, body = exchange(f"{own}/v1/sandboxes/{theirs}", "GET", None, alice)
        assert status == 404 and body == {"error": f"sandbox {theirs} not found"}
        # who may use alice's server is the Hub's business: bob's token is no key to it (401, in forkd's words)
        status, body = exchange(f"{own}/v1/sandboxes", "GET", None, {"Authorization": f"token {hub.tokens['bob']}"})
        assert status == 401 and body == {"error": "invalid bearer token"}
    finally:
        hub.api("DELETE", "/users/alice/server")
        hub.ctl("alice").kill_sandbox(mine)
        hub.ctl("bob").kill_sandbox(theirs)


def test_a_kernels_record_is_its_heads_owners(hub):
    alice, bob = hub.ctl("alice"), hub.ctl("bob")
    mine, theirs = spawn(hub, "alice"), spawn(hub, "bob")
    try:
        alice.set_kernel_head("k-alice", mine, notebook="alice.ipynb")
        assert "k-alice" in {k["kernel_id"] for k in alice.list_kernels()}
        assert "k-alice" not in {k["kernel_id"] for k in bob.list_kernels()}
        assert raw(hub, "bob", "GET", "/v1/kernels/k-alice") == (404, {"error": "kernel k-alice not found"})
        # bob can neither take alice's record over nor point his kernel at her sandbox
        assert raw(hub, "bob", "PUT", "/v1/kernels/k-alice", {"head": theirs})[0] == 404
        assert raw(hub, "bob", "PUT", "/v1/kernels/k-bob", {"head": mine})[0] == 404
        assert raw(hub, "bob", "DELETE", "/v1/kernels/k-alice")[0] == 404
        assert alice.get_kernel("k-alice")["head"] == mine
        alice.kill_sandbox(mine)  # a restarted kernel still finds where it was; bob still does not
        assert alice.get_kernel("k-alice")["head"] == mine
        assert "k-alice" in {k["kernel_id"] for k in alice.list_kernels()}
        assert raw(hub, "bob", "GET", "/v1/kernels/k-alice")[0] == 404
        alice.forget_kernel("k-alice")
    finally:
        for ctl, sid in ((alice, mine), (bob, theirs)):
            if sid in {s["id"] for s in ctl.list_sandboxes()}:
                ctl.kill_sandbox(sid)


def test_the_operator_token_sees_everything(hub):
    mine = spawn(hub, "alice")
    try:
        operator = Controller(hub.forkd_url, hub.operator_token)
        assert mine in {s["id"] for s in operator.list_sandboxes()}
        for path in ("/metrics", "/mcp"):  # the server's whole, or acting with its own token: admins only
            status, body = raw(hub, "alice", "POST" if path == "/mcp" else "GET", path, {} if path == "/mcp" else None)
            assert status == 403 and "admins" in body["error"], (path, status, body)
    finally:
        hub.ctl("alice").kill_sandbox(mine)


def test_workspaces_are_their_makers(hub):
    check_workspaces_are_their_makers(hub, BASE, "workspace alice-ws not found")
