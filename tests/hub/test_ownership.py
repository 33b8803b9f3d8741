"""The ownership rule on wire objects (forkd_server/hub/ownership.py), the Hub's environment read by
``forkd serve``, and the labels a child or branch inherits; no Hub needed."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.serving import FORKD, free_port, serving

from forkd_server.hub import hub_settings, managed_by_hub
from forkd_server.hub.ownership import OWNER, SHARED, Caller, Refused, holders_labels, inheritable

ALICE, BOB, BOSS = Caller("alice"), Caller("bob"), Caller("boss", admin=True)


def test_a_user_sees_their_own_and_shared_snapshots_only():
    hers, shared = {OWNER: "alice"}, {OWNER: "boss", SHARED: "true"}
    assert ALICE.sees(hers) and not BOB.sees(hers) and BOSS.sees(hers)
    assert ALICE.sees(shared, snapshot=True) and BOB.sees(shared, snapshot=True)
    assert not ALICE.sees(shared)  # shared means something for snapshots only
    assert not ALICE.sees({}) and not ALICE.sees(None) and BOSS.sees({})  # unowned: the operator's
    assert not ALICE.sees({OWNER: "boss", SHARED: "yes"}, snapshot=True)  # only "true" shares


def test_only_admins_change_a_shared_snapshot():
    shared_by_alice = {OWNER: "alice", SHARED: "true"}
    assert not ALICE.may_change(shared_by_alice) and BOSS.may_change(shared_by_alice)
    assert ALICE.may_change({OWNER: "alice"}) and not BOB.may_change({OWNER: "alice"})


def test_check_answers_404_for_what_is_not_seen_and_403_for_a_shared_change():
    ALICE.check("sandbox", "sb-1", {OWNER: "alice"}, change=True)
    for labels in ({OWNER: "bob"}, None):
        with pytest.raises(Refused) as refused:
            ALICE.check("sandbox", "sb-1", labels)
        assert (refused.value.status, refused.value.message) == (404, "sandbox sb-1 not found")
    ALICE.check("snapshot", "base", {OWNER: "boss", SHARED: "true"})
    with pytest.raises(Refused) as refused:
        ALICE.check("snapshot", "base", {OWNER: "boss", SHARED: "true"}, change=True)
    assert refused.value.status == 403 and "only admins" in refused.value.message


def test_a_snapshot_several_hosts_hold_has_the_owner_any_holder_names():
    """A copy pulled from the store onto another host carries no labels: the router's merged view
    takes the owner and the share from whichever holder has them, never another label."""
    pulled, made = {"labels": {}}, {"labels": {OWNER: "alice", SHARED: "true", "team": "ml"}}
    assert holders_labels([pulled, made]) == {OWNER: "alice", SHARED: "true"}
    assert holders_labels([made, pulled]) == made["labels"]
    assert holders_labels([{"labels": {OWNER: "alice"}}, {"labels": {OWNER: "bob"}}]) == {OWNER: "alice"}
    assert holders_labels([]) == {}


def test_the_owner_is_stamped_and_server_labels_are_refused():
    assert ALICE.stamp({"team": "ml"}) == {"team": "ml", OWNER: "alice"}
    assert ALICE.stamp(None) == {OWNER: "alice"}
    assert ALICE.stamp({OWNER: "alice"}) == {OWNER: "alice"}  # what the server sets anyway
    for labels in ({OWNER: "bob"}, {SHARED: "true"}, {"forkd.anything": "x"}):
        with pytest.raises(Refused) as refused:
            ALICE.stamp(labels)
        assert refused.value.status == 403 and "set by the server" in refused.value.message
    assert BOSS.stamp({SHARED: "true"}) == {SHARED: "true", OWNER: "boss"}
    with pytest.raises(Refused):
        BOSS.stamp({OWNER: "alice"})  # not even an admin makes things in another's name
    with pytest.raises(Refused):
        ALICE.check_labels({OWNER: "bob"})
    ALICE.check_labels({"step": "2"})


def test_listings_and_the_tree_are_filtered():
    snaps = [{"tag": "a", "labels": {OWNER: "alice"}}, {"tag": "b", "labels": {OWNER: "bob"}},
             {"tag": "s", "labels": {OWNER: "boss", SHARED: "true"}}, {"tag": "o", "labels": {}}]
    assert [s["tag"] for s in ALICE.snapshots(snaps)] == ["a", "s"]
    assert BOSS.snapshots(snaps) == snaps
    nodes = [{"id": "s", "kind": "snapshot", "labels": {OWNER: "boss", SHARED: "true"}},
             {"id": "sb-1", "kind": "sandbox", "labels": {OWNER: "alice"}},
             {"id": "sb-2", "kind": "sandbox", "labels": {OWNER: "bob", SHARED: "true"}}]
    assert [n["id"] for n in ALICE.tree(nodes)] == ["s", "sb-1"]


def test_server_labels_are_not_inherited():
    assert inheritable({OWNER: "boss", SHARED: "true", "team": "ml"}) == {"team": "ml"}
    assert inheritable(None) == {}


def test_the_hubs_environment():
    env = {"JUPYTERHUB_SERVICE_NAME": "forkd", "JUPYTERHUB_API_TOKEN": "t" * 32,
           "JUPYTERHUB_SERVICE_URL": "http://127.0.0.1:10101", "JUPYTERHUB_SERVICE_PREFIX": "/services/forkd/"}
    assert managed_by_hub(env)
    assert hub_settings(env) == {"host": "127.0.0.1", "port": 10101, "base_url": "/services/forkd/"}
    # a single-user server has a Hub token but is no service: a forkd serve started there is not one
    assert not managed_by_hub({"JUPYTERHUB_API_TOKEN": "t" * 32, "JUPYTERHUB_USER": "alice"})
    assert hub_settings({}) == {}


def test_serve_under_the_hub_needs_no_token_and_takes_the_hubs_classes():
    from forkd_server.serve import ServeError, build_argv
    argv, token, generated = build_argv(host="0.0.0.0", hub=True, base_url="/services/forkd/")
    assert token is None and not generated  # the Hub checks every caller: no token, even off loopback
    assert "--ServerApp.identity_provider_class=forkd_server.hub.identity.HubIdentityProvider" in argv
    assert "--ServerApp.authorizer_class=forkd_server.hub.authorizer.HubAuthorizer" in argv
    assert "--ServerApp.base_url=/services/forkd/" in argv
    assert "--ServerApp.disable_check_xsrf=True" not in argv
    # behind the Hub's proxy, Host is the Hub's public name
    assert "--ServerApp.allow_remote_access=True" in build_argv(hub=True)[0]
    with pytest.raises(ServeError):  # without the Hub, off loopback still needs a token
        build_argv(host="0.0.0.0")


def test_each_hub_user_has_a_kernel_base_of_their_own(monkeypatch):
    """forkd as a Hub service hides one user's snapshots from another: a base every kernel shared
    would be alice's, and bob's kernel could neither see nor make it."""
    from forkd_kernel.base import BaseSnapshot

    def tag() -> str:
        return BaseSnapshot(None, engine="process", setup="", packages=[]).tag

    monkeypatch.delenv("JUPYTERHUB_USER", raising=False)
    alone = tag()
    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    alice = tag()
    monkeypatch.setenv("JUPYTERHUB_USER", "bob")
    assert len({alone, alice, tag()}) == 3
    assert alice.startswith("forkd-kernel-process-")


def test_serve_hub_without_the_hubs_environment_says_what_is_missing(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    out = subprocess.run([*FORKD, "serve", "--hub", "--data-dir", str(tmp_path / "d"), "--port", str(free_port())],
                         env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--hub needs JUPYTERHUB_API_TOKEN and JUPYTERHUB_SERVICE_NAME" in out.stderr


def test_a_hub_that_does_not_answer_is_503_and_the_operator_token_still_works():
    """The Hub is down (nothing listens at JUPYTERHUB_API_URL): a Hub token cannot be checked (503,
    try again), no token is 401, and the operator's --token-file token works without the Hub."""
    pytest.importorskip("jupyterhub")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")},
           "JUPYTERHUB_API_TOKEN": "service-token-0123456789abcdef", "JUPYTERHUB_SERVICE_NAME": "forkd",
           "JUPYTERHUB_API_URL": f"http://127.0.0.1:{free_port()}/hub/api"}
    with serving(env=env) as srv:
        assert "JupyterHub authenticates every request" in srv.output()
        assert get(srv, "/v1/sandboxes", "a-hub-token-nobody-can-check-now")[0] == 503
        status, body = get(srv, "/v1/sandboxes", "a-hub-token-nobody-can-check-now")
        assert "cannot check the token with JupyterHub" in body["error"]
        assert get(srv, "/v1/sandboxes", None) == (401, {"error": "missing bearer token"})
        assert get(srv, "/v1/sandboxes", srv.token) == (200, [])


def get(srv, path: str, token: str | None):
    req = urllib.request.Request(srv.url + path, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
