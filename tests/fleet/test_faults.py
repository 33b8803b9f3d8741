"""Faults around ``forkd router``: a host killed with -9 (its sandboxes lost, 410, new work on the
other host, reconciled when it is back), a router killed with -9 (no pin lost), and hosts that
never answer or answer garbage (nobody else waits for them)."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import urllib.request

import pytest

from forkd_server.client import Controller, ControllerError

from ..serving import cleanup
from .fleet import DOWN_AFTER, fleet, stand_in_host, wait_for


@pytest.fixture(scope="module")
def pair():
    """Two hosts and a router, shared by the tests that kill one of them with -9 and start it again
    (each leaves all three up); what a test made is deleted after it, through the router (its pins
    go too) and then on each host."""
    with fleet(2) as (router, hosts):
        yield router, hosts


@pytest.fixture
def two(pair):
    router, hosts = pair
    assert all(h.proc.poll() is None for h in hosts) and router.proc.poll() is None
    yield pair
    cleanup(router.url, router.token)
    for host in hosts:
        cleanup(host.url, host.token)


def test_a_host_killed_with_9_is_down_its_sandboxes_lost_and_back_when_it_returns(two):
    router, hosts = two
    api = Controller(router.url, router.token, timeout=120)
    direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
    for ctl in direct:
        ctl.create_snapshot("twin", setup="x = 1")
    direct[1].create_snapshot("one", setup="x = 2")
    on1 = api.spawn_sandboxes("one", 2)
    assert {k["host"] for k in on1} == {hosts[1].url}
    ids = {k["id"] for k in on1}

    events: list[dict] = []
    subscribed = threading.Event()

    def follow():
        with api.events(timeout=60) as stream:
            subscribed.set()
            for e in stream:
                events.append(e)
                if e.get("kind") == "host" and e.get("action") == "up":
                    return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert subscribed.wait(30)

    hosts[1].crash()  # kill -9: its sandboxes outlive it
    killed_at = time.monotonic()
    lost = wait_for(lambda: {s["id"]: s for s in api.list_sandboxes() if s["status"] == "lost"},
                    "host 1's sandboxes listed lost", timeout=DOWN_AFTER + 30)
    assert set(lost) == ids and all(s["host"] == hosts[1].url for s in lost.values())
    assert "down" in lost[next(iter(ids))]["lost"]["reason"]
    print(f"lost after {time.monotonic() - killed_at:.1f} s (--down-after {DOWN_AFTER} s)")
    assert router.hosts()[hosts[1].url]["state"] == "down"
    with pytest.raises(ControllerError) as err:
        api.eval_code(next(iter(ids)), "x")
    assert err.value.status == 410 and "lost" in str(err.value) and hosts[1].url in str(err.value)
    tree = {n["id"]: n for n in api.tree()}
    assert all(tree[i]["status"] == "lost" for i in ids)
    assert tree["one"]["status"] == "lost" and tree["one"]["host"] == hosts[1].url  # held only there
    assert tree["twin"]["status"] == "ready" and tree["twin"]["host"] == hosts[0].url
    assert {s["tag"]: s["status"] for s in api.list_snapshots()} == {"one": "lost", "twin": "ready"}
    # new work goes to the host that is up
    kids = api.spawn_sandboxes("twin", 3)
    assert {k["host"] for k in kids} == {hosts[0].url}
    with pytest.raises(ControllerError) as err:  # held only by the host that is down
        api.spawn_sandboxes("one")
    assert err.value.status == 410 and hosts[1].url in str(err.value)

    hosts[1].start()  # back on the same port and data dir: reconciled, its sandboxes running again
    hosts[1].wait_healthy()
    wait_for(lambda: router.hosts()[hosts[1].url]["state"] == "up", "host 1 up again")
    reader.join(60)
    assert api.eval_code(next(iter(ids)), "x")["result"] == "2"
    assert {s["id"] for s in api.list_sandboxes() if s["host"] == hosts[1].url} == ids
    assert not [s for s in api.list_sandboxes() if s["status"] == "lost"]
    said = {(e.get("kind"), e.get("action")) for e in events}
    assert {("host", "down"), ("sandbox", "lost"), ("host", "up")} <= said
    assert {e["id"] for e in events if e.get("action") == "lost"} == ids
    for k in kids + on1:
        api.kill_sandbox(k["id"])


def test_a_router_killed_with_9_loses_no_pin(two):
    router, hosts = two
    api = Controller(router.url, router.token, timeout=120)
    Controller(hosts[1].url, hosts[1].token).create_snapshot("kept", setup="x = 3")
    ids = {k["id"] for k in api.spawn_sandboxes("kept", 2)}
    router.stop(kill=True)
    hosts[1].crash()  # the restarted router can only know these from its pins
    router.start()
    lost = wait_for(lambda: {s["id"] for s in Controller(router.url, router.token).list_sandboxes()
                             if s["status"] == "lost"}, "the pinned sandboxes listed lost", timeout=DOWN_AFTER + 30)
    assert lost == ids
    hosts[1].start()
    hosts[1].wait_healthy()
    wait_for(lambda: router.hosts()[hosts[1].url]["state"] == "up", "host 1 up again")
    api = Controller(router.url, router.token, timeout=120)
    for sid in ids:
        assert api.eval_code(sid, "x")["result"] == "3"
        api.kill_sandbox(sid)


class StandIn(http.server.BaseHTTPRequestHandler):
    """A stand-in host's handler: ``answer`` writes a JSON body; no log lines."""

    def answer(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Garbage(StandIn):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>not forkd</html>")

    do_POST = do_GET


class Slow(StandIn):
    """A host whose /healthz is fine and whose listings are empty, until ``slow`` is set: from then
    on everything but /healthz waits (until ``released``, at most 60 s)."""

    slow = threading.Event()
    released = threading.Event()

    def do_GET(self):
        if self.path != "/healthz" and self.slow.is_set():
            self.released.wait(60)
        self.answer(b'{"ok": true}' if self.path == "/healthz" else b"[]")


def test_a_slow_host_delays_no_spawn_and_lists_leave_it_out():
    Slow.slow.clear()
    Slow.released.clear()
    with stand_in_host(Slow, release=Slow.released) as url:
        # the router's reads wait up to 12 s for a host; placement waits 1 s at most
        with fleet(1, extra_hosts=(url,), router_args=("--host-timeout", "12")) as (router, hosts):
            router.wait(lambda h: h["hosts_up"] == 2, "see the slow host up too")
            Controller(hosts[0].url, hosts[0].token).create_snapshot("fast", setup="pass")
            Slow.slow.set()
            # the slow host holds up neither placement nor the call (the client gives up after 8 s)
            api = Controller(router.url, router.token, timeout=8)
            kids = api.spawn_sandboxes("fast", 2)
            assert {k["host"] for k in kids} == {hosts[0].url}
            assert api.eval_code(kids[0]["id"], "1 + 1")["result"] == "2"
            req = urllib.request.Request(f"{router.url}/v1/sandboxes", headers={"Authorization": f"Bearer {router.token}"})
            with urllib.request.urlopen(req, timeout=60) as r:  # a merged list waits --host-timeout
                listed = {s["id"] for s in json.loads(r.read())}
                missing = r.headers["X-Forkd-Hosts-Missing"]
            assert listed == {k["id"] for k in kids} and url in missing and "within 12 s" in missing
            for k in kids:
                api.kill_sandbox(k["id"])


def test_hosts_that_never_answer_or_answer_garbage_stall_nobody():
    with socket.socket() as silent, stand_in_host(Garbage) as garbage:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # connections complete in the backlog and are never answered
        odd = (f"http://127.0.0.1:{silent.getsockname()[1]}", garbage)
        with fleet(1, extra_hosts=odd, router_args=("--host-timeout", "2")) as (router, hosts):
            api = Controller(router.url, router.token, timeout=120)
            Controller(hosts[0].url, hosts[0].token).create_snapshot("fine", setup="pass")
            kids = api.spawn_sandboxes("fine", 2)
            assert {k["host"] for k in kids} == {hosts[0].url}
            states = router.hosts()
            assert states[hosts[0].url]["state"] == "up"
            assert "not forkd" in states[odd[1]]["last_error"] or "not JSON" in states[odd[1]]["last_error"]
            wait_for(lambda: all(router.hosts()[u]["state"] == "down" for u in odd), "the odd hosts down",
                     timeout=DOWN_AFTER + 30)
            assert {s["id"] for s in api.list_sandboxes()} == {k["id"] for k in kids}
            assert {n["id"] for n in api.tree()} == {"fine"} | {k["id"] for k in kids}
            for k in kids:
                api.kill_sandbox(k["id"])


class Unreadable(StandIn):
    """A host whose public /healthz answers at once and whose listings refuse the router's token, a
    moment later each time (as a host started with another token does, over a slow link)."""

    def do_GET(self):
        if self.path.startswith("/healthz"):
            self.answer(b'{"ok": true}')
        else:
            time.sleep(0.5)  # the host taking its time: the router's heartbeat is mid-read meanwhile
            self.answer(b'{"error": "invalid bearer token"}', 401)


def test_a_host_that_refuses_the_router_says_why_at_every_moment():
    """A host not up keeps its reason while the router reads it again: no moment of "not answered
    yet" (what the router says of a host it never heard) between one heartbeat and its listings."""
    with stand_in_host(Unreadable) as url, fleet(1, extra_hosts=(url,)) as (router, _):
        wait_for(lambda: "401" in (router.hosts()[url]["last_error"] or ""), "the refusal seen")
        seen = []
        for _ in range(40):  # over several heartbeats, each mid-read for most of its time
            state = router.hosts()[url]
            seen.append((state["state"], state["last_error"]))
            time.sleep(0.05)
        assert all(st != "up" and err and "401" in err for st, err in seen), seen


class Streaming(StandIn):
    """A host that holds one sandbox, ``sb-stream``, whose file read answers in two chunks, the
    second only once ``go_on`` is set: what reaches the client before that was not buffered."""

    protocol_version = "HTTP/1.1"
    go_on = threading.Event()

    def do_GET(self):
        if self.path == "/healthz":
            self.answer(b'{"ok": true}')
        elif self.path == "/v1/sandboxes/sb-stream":
            self.answer(b'{"id": "sb-stream", "status": "running"}')
        elif self.path.startswith("/v1/sandboxes/sb-stream/files"):
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"first part\n", b"second part\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.flush()
                self.go_on.wait(60)
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.answer(b"[]")


def test_a_streamed_answer_is_passed_on_as_it_arrives():
    Streaming.go_on.clear()
    with stand_in_host(Streaming, release=Streaming.go_on) as url:
        with fleet(0, extra_hosts=(url,)) as (router, _):
            router.wait(lambda h: h["hosts_up"] == 1, "see the streaming host up")
            req = urllib.request.Request(f"{router.url}/v1/sandboxes/sb-stream/files?path=/big",
                                         headers={"Authorization": f"Bearer {router.token}"})
            with urllib.request.urlopen(req, timeout=10) as r:  # a router that buffered would wait 60 s
                assert r.readline() == b"first part\n"  # while the host holds the rest back
                Streaming.go_on.set()
                assert r.read() == b"second part\n"
