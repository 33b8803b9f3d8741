"""A Jupyter server in router mode (``--ForkdApp.router_hosts``) over two real ``forkd serve`` hosts
and no ``forkd router``: its ``{base}forkd/v1/...`` is the fleet's router (placement, pinned calls,
the merged tree and events, the session WebSocket), behind the Jupyter server's own login; the forkd
kernel it starts finds it as it finds any forkd in a Jupyter server and its sandboxes land on the
hosts; a configuration that mixes modes is refused at start-up, saying which options."""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from jupyter_client import BlockingKernelClient

from forkd_server.client import Controller, ControllerError
from tests.serving import JupyterServer, Server, cleanup, free_port

from ..kernel.cells import run
from ..rest import exchange
from .fleet import DOWN_AFTER, HEARTBEAT, HOST_TIMEOUT, fleet
from .test_jupyter_remote import bus_events, call


def router_args(workdir: str, hosts) -> tuple[str, ...]:
    return (f"--ForkdApp.router_hosts={json.dumps([h.url for h in hosts])}",
            f"--ForkdApp.router_hosts_token_file={os.path.join(workdir, 'token')}",
            f"--ForkdApp.router_heartbeat={HEARTBEAT}", f"--ForkdApp.router_down_after={DOWN_AFTER}",
            f"--ForkdApp.router_host_timeout={HOST_TIMEOUT}")


def health(js: JupyterServer) -> dict:
    with urllib.request.urlopen(f"{js.forkd_url}/healthz", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def routed():
    """(jupyter server, hosts): the snapshot ``left`` on host 0, ``right`` on host 1. On exit the
    server must stop cleanly (its router's tasks with it) before the hosts are emptied and stopped."""
    with fleet(2, router=False) as (workdir, hosts):
        for i, tag in enumerate(("left", "right")):
            Controller(hosts[i].url, hosts[i].token, timeout=120).create_snapshot(tag, setup=f"me = {i}")
        js = JupyterServer(args=router_args(workdir, hosts))
        try:
            deadline = time.monotonic() + 60
            while health(js)["hosts_up"] < 2:  # bounded polling: the router's first heartbeats
                assert time.monotonic() < deadline, js.output()[-3000:]
                time.sleep(0.05)
            yield js, hosts
        finally:
            log = js.output()
            js.stop()
        assert js.proc.returncode == 0, log[-3000:]
        assert "Task was destroyed but it is pending" not in log, log[-3000:]  # the router's tasks ended with it
        assert not any("forkd_server" in t[:5000] for t in log.split("Traceback")[1:]), log[-3000:]


def test_spawn_lands_on_the_host_holding_the_snapshot_and_calls_are_pinned(routed):
    js, hosts = routed
    api = Controller(js.forkd_url, js.token, timeout=120)
    snaps = {s["tag"]: s for s in api.list_snapshots()}
    assert snaps["left"]["host"] == hosts[0].url and snaps["right"]["host"] == hosts[1].url
    kids = [api.spawn_sandboxes(tag, 1)[0] for tag in ("left", "right")]
    try:
        assert [k["host"] for k in kids] == [hosts[0].url, hosts[1].url]
        listed = {s["id"]: s["host"] for s in api.list_sandboxes()}
        assert listed == {kids[0]["id"]: hosts[0].url, kids[1]["id"]: hosts[1].url}
        # each child answers from its own snapshot: the call went to its host
        assert [api.eval_code(k["id"], "me")["result"] for k in kids] == ["0", "1"]
        tree = {n["id"]: n for n in api.tree()}
        assert {tree[k]["host"] for k in ("left", kids[0]["id"])} == {hosts[0].url}
        assert {tree[k]["host"] for k in ("right", kids[1]["id"])} == {hosts[1].url}
        # the host that made each one holds it; nothing ran in the Jupyter server
        for kid, host in zip(kids, hosts):
            assert Controller(host.url, host.token).get_sandbox(kid["id"])["id"] == kid["id"]
    finally:
        for k in kids:
            api.kill_sandbox(k["id"])
    assert os.listdir(os.path.join(js.workdir, "d")) == ["router"]  # only the router's state file
    assert os.path.exists(os.path.join(js.workdir, "d", "router", "router.db"))


def test_the_jupyter_login_guards_the_router(routed):
    js, hosts = routed
    assert call(js, "GET", "/forkd/v1/sandboxes", token=None) == (401, {"error": "missing bearer token"})
    assert call(js, "GET", "/forkd/v1/sandboxes", token="x" * 40) == (401, {"error": "invalid bearer token"})
    # the hosts' token is theirs, not a key to this Jupyter server
    assert call(js, "POST", "/forkd/v1/sandboxes", {"snapshot_tag": "left"}, token=hosts[0].token)[0] == 401
    # a call through the router is the server's API activity (what an idle culler reads), as any API call is
    before = js.api("GET", "/api/status")["last_activity"]
    assert call(js, "GET", "/forkd/v1/snapshots")[0] == 200
    assert js.api("GET", "/api/status")["last_activity"] > before
    # /healthz is public, as everywhere; unknown routes under v1 are the router's 404
    status, body = call(js, "GET", "/forkd/healthz", token=None)
    assert status == 200 and body["router"] is True and body["hosts_up"] == 2
    status, body = call(js, "GET", "/forkd/v1/nope")
    assert status == 404 and "not a route" in body["error"]
    # the router's errors keep their words: an unknown id, a bad body, an unknown snapshot
    status, body = call(js, "GET", "/forkd/v1/sandboxes/sb-nope")
    assert status == 404 and "sb-nope" in body["error"]
    assert call(js, "POST", "/forkd/v1/sandboxes", {"snapshot_tag": "left", "n": "two"})[0] == 422
    status, body = call(js, "POST", "/forkd/v1/sandboxes", {"snapshot_tag": "nope", "n": 1})
    assert status == 404 and "nope" in body["error"]
    assert Controller(hosts[0].url, hosts[0].token).list_sandboxes() == []


def logged_in(js: JupyterServer) -> tuple[urllib.request.OpenerDirector, str]:
    """A browser's session with the Jupyter server: logged in with its token on its login page (a
    cookie), and the ``_xsrf`` value its pages send back."""
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    browser.open(f"{js.url}/login", timeout=30).read()
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    form = urllib.parse.urlencode({"password": js.token, "_xsrf": xsrf}).encode()
    browser.open(urllib.request.Request(f"{js.url}/login", data=form), timeout=30).read()
    assert any(c.name.startswith("username-") for c in jar), "the login did not set its cookie"
    return browser, xsrf


def test_a_browser_login_works_with_the_xsrf_check(routed):
    """The Lab panel's way in: the login cookie, and on every change the ``_xsrf`` value too."""
    js, hosts = routed
    browser, xsrf = logged_in(js)
    with browser.open(f"{js.forkd_url}/v1/snapshots", timeout=30) as r:  # a read needs the cookie only
        assert {s["tag"] for s in json.loads(r.read())} == {"left", "right"}
    spawn = b'{"snapshot_tag": "left", "n": 1}'
    headers = {"Content-Type": "application/json"}
    with pytest.raises(urllib.error.HTTPError) as refused:  # a change without it: a forged request
        browser.open(urllib.request.Request(f"{js.forkd_url}/v1/sandboxes", data=spawn, headers=headers), timeout=30)
    assert refused.value.code == 403 and "_xsrf" in json.loads(refused.value.read())["error"]
    assert Controller(hosts[0].url, hosts[0].token).list_sandboxes() == []  # it never reached a host
    with browser.open(urllib.request.Request(f"{js.forkd_url}/v1/sandboxes", data=spawn,
                                             headers={**headers, "X-XSRFToken": xsrf}), timeout=30) as r:
        kid = json.loads(r.read())[0]
    try:
        assert r.status == 201 and kid["host"] == hosts[0].url
    finally:
        Controller(js.forkd_url, js.token).kill_sandbox(kid["id"])


def test_a_session_streams_through_to_the_sandbox_host(routed):
    js, _ = routed
    api = Controller(js.forkd_url, js.token, timeout=120)
    kid = api.spawn_sandboxes("right", 1)[0]["id"]
    try:
        printed = []
        with api.session(kid) as session:
            reply = session.execute("print('on', me)", on_event=lambda e: e.get("type") == "stream" and printed.append(
                e["text"]))
            assert reply["status"] == "ok" and "".join(printed) == "on 1\n"
        with pytest.raises(ControllerError) as refused:  # the router's refusal, before the upgrade
            api.session("sb-nope").__enter__()
        assert refused.value.status == 404 and "sb-nope" in refused.value.message
    finally:
        api.kill_sandbox(kid)


def test_the_fleet_changes_reach_the_jupyter_event_bus(routed):
    js, hosts = routed
    api = Controller(js.forkd_url, js.token, timeout=120)
    made = []
    event = asyncio.run(bus_events(js, lambda: made.extend(api.spawn_sandboxes("left", 1)),
                                   lambda e: e.get("action") == "created" and e.get("kind") == "sandbox"))
    try:
        assert event["id"] == made[0]["id"] and event["host"] == hosts[0].url
    finally:
        api.kill_sandbox(made[0]["id"])


def test_the_forkd_kernel_of_the_server_works_on_the_hosts(routed):
    """A forkd kernel the server starts (``POST /api/kernels``, as a notebook's) finds the server by
    itself (no FORKD_URL): its notebook's sandboxes and the record of its HEAD are on the hosts, the
    tree shows them, and the panel's "Check out" (``POST {base}forkd/v1/kernels/{id}/checkout``) moves
    it, run in that kernel here."""
    js, hosts = routed
    kernel = js.api("POST", "/api/kernels", {"name": "forkd-python"})["id"]
    kc = BlockingKernelClient(connection_file=os.path.join(js.workdir, "rt", f"kernel-{kernel}.json"))
    kc.load_connection_file()
    # no heartbeat of its own: the server watches the kernel's, and a new client's says "dead" until it beats
    kc.start_channels(hb=False)
    api = Controller(js.forkd_url, js.token, timeout=120)
    try:
        kc.wait_for_ready(timeout=60)
        assert run(kc, "x = 21").ok
        assert run(kc, "kids = %forkd fork -n 2").ok
        drawn = run(kc, "%%forkd run kids\nx * 2")
        assert drawn.ok and drawn.result.count("\n42") == 2, drawn.text
        tree = run(kc, "%forkd tree")  # the lineage widget, over this server's merged tree
        assert tree.ok and f":{js.port}/forkd': 2 snapshots, 3 sandboxes of this kernel" in tree.text, tree.text
        mine = api.list_sandboxes()
        assert len(mine) == 3 and {s["host"] for s in mine} <= {h.url for h in hosts}
        assert all(n["host"] in {h.url for h in hosts} for n in api.tree())
        record = api.get_kernel(kernel)  # the notebook's HEAD, recorded on its host
        assert record["head"] in {s["id"] for s in mine}
        assert [k["host"] for k in api.list_kernels()] == [{s["id"]: s["host"] for s in mine}[record["head"]]]
        kids = sorted(s["id"] for s in mine if s["id"] != record["head"])

        assert run(kc, "x = 99").ok
        moved = api.checkout_kernel(kernel, kids[1])
        assert moved["head"] == kids[1] and api.get_kernel(kernel)["head"] == kids[1]
        assert run(kc, "x").result == "21"  # the next cell runs in the child, with its state
        with pytest.raises(ControllerError) as refused:  # an unknown sandbox: the router's 404, the kernel untouched
            api.checkout_kernel(kernel, "sb-nope")
        assert refused.value.status == 404 and "sb-nope" in refused.value.message
    finally:
        kc.stop_channels()
        js.api("DELETE", f"/api/kernels/{kernel}")
        for s in api.list_sandboxes():
            api.kill_sandbox(s["id"])
        for s in api.list_snapshots():
            if s["tag"] not in ("left", "right"):
                api.delete_snapshot(s["tag"])


def test_a_host_that_goes_down_is_followed_by_the_servers_heartbeat(routed):
    """Last of the tests on ``routed``: the router's heartbeat runs in the Jupyter server, so a host
    killed with -9 is down within ``router_down_after``, its sandbox lost (410), new work placed on
    the other; back, it is reconciled and its sandbox answers again."""
    js, hosts = routed
    api = Controller(js.forkd_url, js.token, timeout=120)
    kid = api.spawn_sandboxes("right", 1)[0]["id"]
    hosts[1].crash()
    try:
        deadline = time.monotonic() + 30 + DOWN_AFTER
        while health(js)["hosts_up"] != 1:
            assert time.monotonic() < deadline, js.output()[-3000:]
            time.sleep(0.05)
        with pytest.raises(ControllerError) as lost:
            api.eval_code(kid, "me")
        assert lost.value.status == 410 and hosts[1].url in lost.value.message
        assert {s["id"]: s["status"] for s in api.list_sandboxes()}[kid] == "lost"
        other = api.spawn_sandboxes("left", 1)[0]
        assert other["host"] == hosts[0].url
        api.kill_sandbox(other["id"])
    finally:
        hosts[1].start()
        hosts[1].wait_healthy()
    deadline = time.monotonic() + 60
    while health(js)["hosts_up"] != 2:
        assert time.monotonic() < deadline, js.output()[-3000:]
        time.sleep(0.05)
    hosts[1].wait_settled()
    assert api.eval_code(kid, "me")["result"] == "1"
    api.kill_sandbox(kid)


def post(url: str, body, token: str | None) -> tuple[int, dict]:
    return exchange(url, "POST", body, {"Authorization": f"Bearer {token}"} if token else None)


def test_hosts_register_themselves_with_the_jupyter_server():
    """``router_register_token_file`` alone: a ``forkd serve --register {server}/forkd`` host joins
    the table with the registration token (not a Jupyter login), and work is placed on it. Under a
    ``base_url``, as a JupyterHub user server has one: every path a host sees is its own ``/v1/...``."""
    with fleet(0, router=False) as (workdir, _):
        register_file = os.path.join(workdir, "register-token")
        with open(register_file, "w") as f:
            f.write("r" * 40)
        js = JupyterServer(args=(f"--ForkdApp.router_register_token_file={register_file}",
                                 f"--ForkdApp.router_hosts_token_file={os.path.join(workdir, 'token')}",
                                 f"--ForkdApp.router_heartbeat={HEARTBEAT}"), base_url="/user/alice/")
        host = None
        try:
            endpoint = f"{js.forkd_url}/v1/fleet/register"
            assert post(endpoint, {"url": "http://127.0.0.1:1"}, None) == (401, {"error": "missing bearer token"})
            assert post(endpoint, {"url": "http://127.0.0.1:1"}, js.token) == (401, {"error": "invalid bearer token"})
            host = Server("--token-file", os.path.join(workdir, "token"), "--register", js.forkd_url,
                          "--register-token-file", register_file, data_dir=os.path.join(workdir, "h"),
                          env={**os.environ, "JUPYTER_RUNTIME_DIR": os.path.join(workdir, "rt")})
            host.wait_healthy()
            deadline = time.monotonic() + 30
            while health(js)["hosts_up"] != 1:  # bounded polling: its first announcement
                assert time.monotonic() < deadline, js.output()[-3000:] + host.output()[-3000:]
                time.sleep(0.05)
            api = Controller(js.forkd_url, js.token, timeout=120)
            assert api.create_snapshot("joined", setup="here = 1")["host"] == host.url
            kid = api.spawn_sandboxes("joined", 1)[0]
            assert kid["host"] == host.url and api.eval_code(kid["id"], "here")["result"] == "1"
            with api.session(kid["id"]) as session:  # the WebSocket too
                assert session.execute("here")["status"] == "ok"
            assert "hosts may register themselves at /user/alice/forkd/v1/fleet/register" in js.output()
        finally:
            js.stop()
            if host is not None:
                with open(os.path.join(workdir, "token")) as f:
                    cleanup(host.url, f.read())
                host.stop()


def refused_start(workdir, *args: str, env: dict | None = None) -> str:
    """Start a Jupyter server with ``args``; it must exit non-zero by itself: what it said."""
    base = {k: v for k, v in os.environ.items() if k not in ("FORKD_URL", "FORKD_TOKEN")}
    workdir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", f"--port={free_port()}",
         f"--ServerApp.root_dir={workdir}", *args,
         *([] if any(a.startswith("--ForkdApp.data_dir=") for a in args) else [f"--ForkdApp.data_dir={workdir}/d"])],
        env={**base, "JUPYTER_RUNTIME_DIR": f"{workdir}/rt", **(env or {})}, capture_output=True, text=True,
        timeout=120, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    return proc.stderr


def test_a_configuration_mixing_modes_is_refused_at_start(tmp_path):
    """Each refused start says which options and what to do; the four servers start side by side."""
    hosts = ("--ForkdApp.router_hosts=http://127.0.0.1:1",)
    (tmp_path / "file").write_text("")  # a data dir that cannot be one
    cases = [(hosts, {"FORKD_URL": "http://127.0.0.1:2"},
              ["c.ForkdApp.router_hosts", "c.ForkdApp.remote_url = 'http://127.0.0.1:2' (from $FORKD_URL)"]),
             ((*hosts, "--ForkdApp.default_engine=process", "--ForkdApp.max_sandboxes=3"), None,
              ["c.ForkdApp.router_hosts", "c.ForkdApp.default_engine, c.ForkdApp.max_sandboxes"]),
             (("--ForkdApp.router_hosts=127.0.0.1:8889",), None,
              ["c.ForkdApp.router_hosts: '127.0.0.1:8889' is not a host's URL"]),
             ((*hosts, f"--ForkdApp.data_dir={tmp_path / 'file'}"), None,
              ["cannot keep the router's host table and pins in", "c.ForkdApp.data_dir"])]
    with ThreadPoolExecutor(len(cases)) as pool:
        said = list(pool.map(lambda i: refused_start(tmp_path / f"c{i}", *cases[i][0], env=cases[i][1]),
                             range(len(cases))))
    for (_, _, words), text in zip(cases, said):
        assert all(w in text for w in words), text[-3000:]


def test_forkd_serve_stays_a_host_whatever_the_jupyter_config_says(tmp_path):
    """Router mode set in the user's Jupyter config (for their `jupyter lab`) does not turn the
    `forkd serve` on the same machine into a router: a host runs sandboxes, as it never forwards."""
    config = tmp_path / "config"
    config.mkdir()
    for name in ("jupyter_server_config.json", "jupyter_forkd_config.json", "forkd-serve_config.json"):
        (config / name).write_text(json.dumps({"ForkdApp": {"router_hosts": ["http://127.0.0.1:1"]}}))
    srv = Server("--no-token", data_dir=str(tmp_path / "d"),
                 env={**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")})
    try:
        srv.wait_healthy()
        assert "router" not in srv.health()
        assert Controller(srv.url).list_sandboxes() == []
    finally:
        srv.stop()
