"""Hosts that register themselves: ``forkd router --register-token-file F`` with no host list, and
``forkd serve --register ROUTER_URL --register-token-file F`` on each host (real processes). The
router takes only the registration token; a host that stops announcing is down after
``--down-after`` though its /healthz answers; the table survives a router restart."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from forkd_server.client import Controller

from ..serving import Server, cleanup, refusals
from .fleet import DOWN_AFTER, Router, stop_hosts


def post(url: str, body, token: str | None, raw: bool = False) -> tuple[int, dict]:
    data = body if raw else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_state(router: Router, url: str, state: str, timeout: float = 30) -> dict:
    """Bounded polling of the router's host table until ``url`` is in ``state``."""
    deadline = time.monotonic() + timeout
    while True:
        host = router.hosts().get(url)
        if host is not None and host["state"] == state:
            return host
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} is not {state} within {timeout} s: {host}\n{router.output()[-3000:]}")
        time.sleep(0.05)


@contextlib.contextmanager
def registered_fleet(n_hosts: int = 2):
    """A router taking registrations, and ``n_hosts`` hosts registering themselves with it; plus one
    host that does not (``quiet``), for the test to announce by hand."""
    workdir = tempfile.mkdtemp(prefix="fkrg")
    token, register_token = secrets.token_hex(20), secrets.token_hex(20)
    token_file, register_file = os.path.join(workdir, "token"), os.path.join(workdir, "register-token")
    for path, value in ((token_file, token), (register_file, register_token)):
        with open(path, "w") as f:
            f.write(value)
    router, hosts = None, []
    try:
        router = Router([], workdir, "--register-token-file", register_file)
        for i in range(n_hosts + 1):
            joins = ["--register", router.url, "--register-token-file", register_file] if i < n_hosts else []
            srv = Server("--token-file", token_file, *joins, data_dir=os.path.join(workdir, f"h{i}"),
                         env={**os.environ, "JUPYTER_RUNTIME_DIR": os.path.join(workdir, f"rt{i}")})
            srv.token = token
            hosts.append(srv)
        for srv in hosts:
            srv.wait_healthy()
        router.wait(lambda h: h["hosts_up"] >= n_hosts, "see every registering host up")
        yield router, hosts[:n_hosts], hosts[n_hosts], register_token
    finally:
        if router is not None:
            router.stop()
        stop_hosts(hosts, token)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def registered():
    """One registering fleet for the tests below, in either order: each leaves its hosts and router up
    (the quiet host registered or not); what a test made is deleted after it, on each host."""
    with registered_fleet() as world:
        yield world


@pytest.fixture
def fleet_of(registered):
    router, hosts, quiet, _ = registered
    assert all(h.proc.poll() is None for h in [*hosts, quiet]) and router.proc.poll() is None
    yield registered
    for host in [*hosts, quiet]:
        cleanup(host.url, host.token)


def test_hosts_register_themselves_and_the_router_places_on_them(fleet_of):
    router, hosts, quiet, register_token = fleet_of
    table = router.hosts()
    assert {h.url for h in hosts} == set(table)  # the quiet one did not register
    assert all(table[h.url]["registered"] and table[h.url]["state"] == "up" for h in hosts)
    direct = Controller(hosts[1].url, hosts[1].token, timeout=120)
    direct.create_snapshot("reg", setup="where = 1")
    api = Controller(router.url, router.token, timeout=120)
    kid = api.spawn_sandboxes("reg", 1)[0]
    assert kid["host"] == hosts[1].url and api.eval_code(kid["id"], "where")["result"] == "1"

    # only the registration token registers a host; what is not a host's URL is refused
    endpoint = f"{router.url}/v1/fleet/register"
    assert post(endpoint, {"url": quiet.url}, None) == (401, {"error": "missing bearer token"})
    assert post(endpoint, {"url": quiet.url}, router.token) == (401, {"error": "invalid bearer token"})
    status, body = post(endpoint, {"url": "ftp://x:1"}, register_token)
    assert status == 400 and "is not a host's URL" in body["error"], body
    status, body = post(endpoint, {"url": "http://u:p@127.0.0.1:1"}, register_token)
    assert status == 400 and "no user" in body["error"], body
    status, body = post(endpoint, b"{not json", register_token, raw=True)
    assert status == 400 and '{"url"' in body["error"], body
    assert quiet.url not in router.hosts()

    # a host announced once and then silent goes down after --down-after, its /healthz answering
    status, body = post(endpoint, {"url": quiet.url}, register_token)
    assert status == 200 and body["state"] == "up" and body["announce_every"] > 0, body
    assert body["down_after"] == DOWN_AFTER
    down = wait_state(router, quiet.url, "down", timeout=DOWN_AFTER + 30)
    assert "has not announced itself" in down["reason"], down
    assert quiet.health()["ok"]
    for h in hosts:  # the others keep announcing
        assert router.hosts()[h.url]["state"] == "up"
    status, body = post(endpoint, {"url": quiet.url}, register_token)
    assert status == 200 and body["state"] == "up", body
    api.kill_sandbox(kid["id"])


def test_registered_hosts_outlive_a_router_restart(fleet_of):
    router, hosts, _, _ = fleet_of
    api = Controller(router.url, router.token, timeout=120)
    Controller(hosts[1].url, hosts[1].token, timeout=120).create_snapshot("stay", setup="v = 5")
    kid = api.spawn_sandboxes("stay", 1)[0]["id"]
    hosts[1].crash()  # kill -9: no more announcements, no /healthz
    down = wait_state(router, hosts[1].url, "down", timeout=DOWN_AFTER + 30)
    assert down["registered"]
    router.stop()
    router.start()
    # the table came from the state file: host 1 is still there, down, its sandbox lost
    assert router.hosts()[hosts[1].url]["state"] == "down"
    lost = {s["id"]: s for s in api.list_sandboxes()}
    assert lost[kid]["status"] == "lost" and lost[kid]["host"] == hosts[1].url
    wait_state(router, hosts[0].url, "up")
    hosts[1].start()  # it announces itself again: up, and its sandbox (which outlived it) answers
    hosts[1].wait_healthy()
    wait_state(router, hosts[1].url, "up", timeout=60)
    assert api.eval_code(kid, "v")["result"] == "5"
    api.kill_sandbox(kid)


REFUSED = [
    (["--register", "http://127.0.0.1:1"], "--register needs --register-token-file"),
    (["--register-token-file", "/nonexistent"], "go with --register"),
    (["--register", "nope", "--register-token-file", "/nonexistent"], "is not a router's URL"),
    (["--host", "0.0.0.0", "--token-file", "{token}", "--register", "http://127.0.0.1:1", "--register-token-file",
      "{token}"], "pass --advertise-url"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """What ``forkd serve`` says to each line above ({args: (exit code, stderr)}), all asked of one process."""
    tmp = tmp_path_factory.mktemp("refused")
    token = tmp / "token"
    token.write_text(secrets.token_hex(20))
    lines = [["serve", "--data-dir", str(tmp / "d"), *(a.replace("{token}", str(token)) for a in args)]
             for args, _ in REFUSED]
    return dict(zip((tuple(args) for args, _ in REFUSED), refusals(lines)))


@pytest.mark.parametrize("args, message", REFUSED)
def test_serve_refuses_registration_options_that_cannot_work(refused, args, message):
    code, stderr = refused[tuple(args)]
    assert code == 2 and message in stderr, stderr


@pytest.mark.parametrize("status, body, fix", [
    (401, b'{"error": "invalid bearer token"}',
     "--register-token-file must hold the token the router was started with"),
    (404, b"", "is --register the router's URL, and was it started with --register-token-file?"),
])
def test_a_refused_registration_says_what_to_fix(status, body, fix):
    """A wrong registration token (or a router that takes no registrations) is said in the host's log
    with the flag to fix, not only the router's status."""
    import asyncio
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from forkd_server.announce import Announcer

    class Refusing(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    said = []
    log = logging.getLogger("test-announce")
    log.addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: said.append(r.getMessage())})())
    try:
        ok = asyncio.run(Announcer(f"http://127.0.0.1:{server.server_port}", "t" * 32, "http://127.0.0.1:1",
                                   log).announce())
    finally:
        server.shutdown()
        server.server_close()
    assert ok is False and len(said) == 1 and f"refused the registration ({status})" in said[0], said
    assert fix in said[0], said
