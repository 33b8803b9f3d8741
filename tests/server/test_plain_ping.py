"""``forkd serve``'s plain pings (plain_ping.py): answered without a ``RequestHandler`` with what
``PingHandler`` answers, headers included; every other ping, and every failure, gets
``PingHandler``'s own answer."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.parse

import pytest

from forkd_server.client import Controller

from ..signals import stopped
from .test_control_under_load import metrics


@pytest.fixture(scope="module")
def sid(server):
    ctl = Controller(server.url, server.token)
    ctl.create_snapshot("plain", setup="x = 1")
    return ctl.spawn_sandboxes("plain", 1)[0]["id"]


def ask(server, path: str, headers: dict | None = None, body: bytes | None = None, token: str | None = "server",
        conn: http.client.HTTPConnection | None = None) -> tuple[int, dict, dict]:
    """(status, headers but Date and Content-Length, JSON body) of a POST to ``path``."""
    url = urllib.parse.urlsplit(server.url)
    own = conn is None
    conn = conn or http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    sent = dict(headers or {})
    if token:
        sent["Authorization"] = f"Bearer {server.token if token == 'server' else token}"
    try:
        conn.request("POST", path, body=body, headers=sent)
        resp = conn.getresponse()
        data = resp.read()
        got = {k: v for k, v in resp.getheaders() if k not in ("Date", "Content-Length")}
        assert resp.getheader("Date") and int(resp.getheader("Content-Length")) == len(data)
        return resp.status, got, json.loads(data)
    finally:
        if own:
            conn.close()


def plain_pings(server) -> float:
    """Pings answered without ``PingHandler`` so far (the server's forkd_plain_pings_total)."""
    return metrics(server.url, server.token)["forkd_plain_pings_total"]


def test_a_plain_ping_gets_the_handlers_answer_without_the_handler(server, sid):
    path = f"/v1/sandboxes/{sid}/ping"
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.url).hostname,
                                      urllib.parse.urlsplit(server.url).port, timeout=30)
    before = plain_pings(server)
    first = ask(server, path, conn=conn)  # PingHandler's: its headers are learned
    later = [ask(server, path, conn=conn) for _ in range(3)]  # one kept connection, as an SDK's
    conn.close()
    assert plain_pings(server) - before == 3
    for status, headers, body in [first, *later]:
        assert status == 200 and headers == first[1], (headers, first[1])
        assert body.keys() == first[2].keys() and body["pong"] is True and body["sandbox_id"] == sid
    assert first[1]["Content-Type"] == "application/json" and "Content-Security-Policy" in first[1]


@pytest.mark.parametrize("case", ["wrong token", "no token", "token in the query", "an Origin", "a body",
                                  "no such sandbox", "an id that is not UTF-8"])
def test_a_ping_that_is_not_plain_gets_the_handlers_own_answer(server, sid, case):
    path, headers, body, token = f"/v1/sandboxes/{sid}/ping", {}, None, "server"
    ask(server, path)  # a plain ping seen first: the plain way is open
    if case == "wrong token":
        token = "0" * len(server.token)
    elif case == "no token":
        token = None
    elif case == "token in the query":
        path, token = f"{path}?token={server.token}", None
    elif case == "an Origin":
        headers = {"Origin": "http://client.example"}
    elif case == "a body":
        headers, body = {"Content-Type": "application/json"}, b"{}"
    elif case == "no such sandbox":
        path = "/v1/sandboxes/sb-00000000-0000/ping"
    else:
        path = "/v1/sandboxes/%ff/ping"
    before = plain_pings(server)
    status, got, answer = ask(server, path, headers, body, token)
    assert plain_pings(server) == before, case  # PingHandler answered
    expected = {"wrong token": (401, {"error": "invalid bearer token"}),
                "no token": (401, {"error": "missing bearer token"}),
                "no such sandbox": (404, {"error": "sandbox sb-00000000-0000 not found"})}
    if case in expected:
        assert (status, answer) == expected[case]
    elif case == "an id that is not UTF-8":
        assert status == 400 and "error" in answer
    else:
        assert status == 200 and answer["sandbox_id"] == sid
    if case == "an Origin":  # jupyter_server's CORS answer to a token's call, which a plain ping never has
        assert got["Access-Control-Allow-Origin"] == "http://client.example"


def test_a_frozen_or_killed_sandboxs_ping_is_the_handlers(server):
    ctl = Controller(server.url, server.token)
    sid = ctl.spawn_sandboxes("plain", 1)[0]["id"]
    path = f"/v1/sandboxes/{sid}/ping"
    assert ask(server, path)[0] == 200
    ctl.freeze_sandbox(sid)
    before = plain_pings(server)
    status, _, answer = ask(server, path)  # not running: PingHandler wakes it, as before
    assert status == 200 and answer["sandbox_id"] == sid
    assert ctl.get_sandbox(sid)["tier"] == "running"
    ctl.kill_sandbox(sid)
    status, _, answer = ask(server, path)
    assert status in (404, 410) and sid in answer["error"]
    assert plain_pings(server) == before


def test_a_plain_ping_whose_agent_fails_is_explained_by_the_handler_and_not_made_again(server):
    """A plain ping's failure gets PingHandler's answer for it: a silent agent's 500 after the ping's
    one 5 s timeout (not a second try's 5 s more), a killed agent's 410 or 404."""
    ctl = Controller(server.url, server.token)
    sb = ctl.spawn_sandboxes("plain", 1)[0]
    sid, pid, path = sb["id"], sb["pid"], f"/v1/sandboxes/{sb['id']}/ping"
    assert ask(server, path)[0] == 200
    before = plain_pings(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while not stopped(pid):  # a stop takes each thread in turn
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        status, _, answer = ask(server, path)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert status == 500 and "did not answer within 5 s" in answer["error"], answer
    assert took < 9, f"{took:.1f} s: the ping was made twice"
    assert ask(server, path)[0] == 200
    os.kill(pid, signal.SIGKILL)
    status, _, answer = ask(server, path)
    assert status in (404, 410) and sid in answer["error"], (status, answer)
    assert plain_pings(server) == before + 1  # only the ping between the two failures was plain


@pytest.mark.parametrize("provider", ["forkd", "hub", "jupyter"])
def test_only_forkd_serves_own_identity_answers_plain_pings(provider):
    """Under ``--hub`` (the Hub's identity decides who sees what) or any other identity provider,
    every ping is PingHandler's."""
    from jupyter_server.auth.identity import IdentityProvider

    from forkd_server.hub.identity import HubIdentityProvider
    from forkd_server.identity import ForkdIdentityProvider
    from forkd_server.serve import ForkdServerApp

    cls = {"forkd": ForkdIdentityProvider, "hub": HubIdentityProvider, "jupyter": IdentityProvider}[provider]
    app = ForkdServerApp()
    try:
        app.identity_provider = cls(parent=app)
        assert app.answers_plain_pings is (provider == "forkd")
    finally:
        ForkdServerApp.clear_instance()
