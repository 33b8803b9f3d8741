"""Placement on the snapshot listings the router keeps: while a host's event stream is open and has
said nothing about its snapshots since the router read its listing, a spawn is placed on that
listing without asking the host; a snapshot event makes the next spawn read it again, and a part
the host refuses because the kept listing trailed it (the event still on its way) is placed again
on a fresh listing, whose answer stands.

The host here is a stand-in that counts the listings it is asked for and sends the events the test
gives it, so that an event "still on its way" is one it has not sent."""

from __future__ import annotations

import http.server
import json
import queue
import threading

import pytest

from forkd_server.client import Controller, ControllerError

from .fleet import fleet, stand_in_host


class FakeHost(http.server.BaseHTTPRequestHandler):
    """Holds snapshot ``t`` (process engine, ready) until ``gone`` is set; spawns answer made-up
    children. ``reads``: its snapshot listings asked for; ``spawns``: the spawns it was sent."""

    gone = threading.Event()
    stop = threading.Event()
    events: queue.Queue = queue.Queue()
    reads = spawns = made = 0
    lock = threading.Lock()

    def _json(self, status: int, body) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/healthz":
            self._json(200, {"ok": True})
        elif path == "/v1/events":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b": open\n\n")
            self.wfile.flush()
            while not self.stop.is_set():
                try:
                    event = self.events.get(timeout=0.1)
                except queue.Empty:
                    continue
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
        elif path == "/v1/snapshots":
            with self.lock:
                type(self).reads += 1
            self._json(200, [] if self.gone.is_set() else [{"tag": "t", "status": "ready", "engine": "process"}])
        else:  # sandboxes, workspaces: none
            self._json(200, [])

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            type(self).spawns += 1
            first = type(self).made
            type(self).made += body["n"]
        if self.gone.is_set():
            self._json(404, {"error": "snapshot t not found"})
            return
        self._json(201, [{"id": f"sb-fake-{first + i:04x}", "snapshot_tag": "t", "status": "running"}
                         for i in range(body["n"])])

    def do_DELETE(self):
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_fleet():
    FakeHost.gone.clear()
    FakeHost.stop.clear()
    FakeHost.reads = FakeHost.spawns = FakeHost.made = 0
    with stand_in_host(FakeHost, release=FakeHost.stop) as url, fleet(0, extra_hosts=(url,)) as (router, _):
        router.wait(lambda h: h["hosts_up"] == 1, "see the stand-in host up")
        yield router, Controller(router.url, router.token, timeout=60)


def kept(api: Controller) -> None:
    """Wait until a spawn is placed without a read (the stream open, its listing read since)."""
    for _ in range(200):
        before = FakeHost.reads
        api.spawn_sandboxes("t", 1)
        if FakeHost.reads == before:
            return
    raise AssertionError("every spawn read the host's listing: the kept one was never current")


def test_spawns_use_the_kept_listing_until_a_snapshot_event(fake_fleet):
    router, api = fake_fleet
    kept(api)
    reads = FakeHost.reads
    kids = api.spawn_sandboxes("t", 3)
    assert len(kids) == 3 and FakeHost.reads == reads  # placed without asking the host
    stream = api.events(timeout=30)
    FakeHost.events.put({"kind": "snapshot", "action": "created", "tag": "u", "status": "writing"})
    for event in stream:  # the router passes an event on after it has learnt from it
        if event.get("kind") == "snapshot" and event.get("tag") == "u":
            break
    stream.close()
    api.spawn_sandboxes("t", 1)
    assert FakeHost.reads == reads + 1  # the event made the kept listing stale: read again


def test_a_part_refused_on_a_stale_kept_listing_is_placed_again_on_a_fresh_one(fake_fleet):
    router, api = fake_fleet
    kept(api)
    reads, spawns = FakeHost.reads, FakeHost.spawns
    FakeHost.gone.set()  # deleted on the host, its event not sent yet
    with pytest.raises(ControllerError) as err:
        api.spawn_sandboxes("t", 2)
    assert err.value.status == 404 and "not found on any host of the fleet" in str(err.value)
    assert FakeHost.spawns == spawns + 1  # the kept plan's part, refused
    assert FakeHost.reads == reads + 1  # then a fresh listing, which has no `t`: the router's own 404
