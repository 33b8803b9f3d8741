"""A Jupyter server in remote mode (``FORKD_URL`` in its environment) in front of a real router and two
real ``forkd serve`` hosts: its ``{base}forkd/v1/...`` is the fleet (lists, the tree with each node's
host, spawns, pinned calls, the event stream and jupyter_server's event bus), its own login still
applies, the remote's token never leaves it, and a remote that cannot be used is said."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request

import pytest
from jupyter_client import BlockingKernelClient
from tornado import httpclient, websocket

from forkd_server.client import Controller, ControllerError
from tests.serving import JupyterServer, free_port

from ..kernel.cells import run
from .fleet import fleet


def call(js: JupyterServer, method: str, path: str, body=None, token: str | None = "own") -> tuple[int, dict]:
    """``method path`` on the Jupyter server: (status, parsed body)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"token {js.token if token == 'own' else token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(js.url + path, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.fixture(scope="module")
def remote():
    """(jupyter server, router, hosts): the snapshot ``left`` on host 0, ``right`` on host 1."""
    with fleet(2) as (router, hosts):
        for i, tag in enumerate(("left", "right")):
            Controller(hosts[i].url, hosts[i].token, timeout=120).create_snapshot(tag, setup=f"me = {i}")
        js = JupyterServer(env={"FORKD_URL": router.url, "FORKD_TOKEN": router.token})
        try:
            yield js, router, hosts
        finally:
            js.stop()


def test_lists_tree_and_calls_reach_the_fleet(remote):
    js, _, hosts = remote
    api = Controller(js.forkd_url, js.token, timeout=120)
    snaps = {s["tag"]: s for s in api.list_snapshots()}
    assert snaps["left"]["host"] == hosts[0].url and snaps["right"]["host"] == hosts[1].url
    kids = [api.spawn_sandboxes(tag, 1)[0] for tag in ("left", "right")]
    try:
        assert [k["host"] for k in kids] == [hosts[0].url, hosts[1].url]
        listed = {s["id"]: s["host"] for s in api.list_sandboxes()}
        assert listed == {kids[0]["id"]: hosts[0].url, kids[1]["id"]: hosts[1].url}
        tree = {n["id"]: n for n in api.tree()}
        assert {tree[k]["host"] for k in ("left", kids[0]["id"])} == {hosts[0].url}
        assert {tree[k]["host"] for k in ("right", kids[1]["id"])} == {hosts[1].url}
        # a call about a sandbox reaches its host: each child answers from its own snapshot
        assert [api.eval_code(k["id"], "me")["result"] for k in kids] == ["0", "1"]
        # the memory the panel asks for comes with the tree
        status, nodes = call(js, "GET", "/forkd/v1/tree?memory=true")
        assert status == 200 and all(n.get("memory") for n in nodes if n["kind"] == "sandbox")
    finally:
        for k in kids:
            api.kill_sandbox(k["id"])
    # no forkd of its own: no data dir was made
    assert not os.path.exists(os.path.join(js.workdir, "d"))


def test_errors_pass_through_and_the_jupyter_login_still_applies(remote):
    js, router, _ = remote
    status, body = call(js, "GET", "/forkd/v1/sandboxes/sb-nope")
    assert status == 404 and "sb-nope" in body["error"]
    status, body = call(js, "POST", "/forkd/v1/sandboxes", {"snapshot_tag": "nope", "n": 1})
    assert status == 404 and "nope" in body["error"]
    status, body = call(js, "POST", "/forkd/v1/sandboxes", {"snapshot_tag": "left", "n": "two"})
    assert status == 422 and "error" in body
    # who may call is the Jupyter server's business: no token, or the router's own, is refused here
    assert call(js, "GET", "/forkd/v1/sandboxes", token=None)[0] == 401
    assert call(js, "GET", "/forkd/v1/sandboxes", token=router.token)[0] == 401
    # /healthz is public and passed on; /version is this extension's (the Lab extension checks it)
    for token in (None, "own"):
        status, body = call(js, "GET", "/forkd/healthz", token=token)
        assert status == 200 and body["ok"] is True and body["router"] is True and body["hosts_up"] == 2
    status, body = call(js, "GET", "/forkd/version")
    assert status == 200 and body["api"] == "v1"


def read_events(js: JupyterServer, into: queue.Queue, opened: threading.Event, stop: threading.Event) -> None:
    req = urllib.request.Request(f"{js.forkd_url}/v1/events", headers={"Authorization": f"token {js.token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        opened.set()
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:"):
                into.put(json.loads(line[5:]))
            if stop.is_set():
                return


def test_the_event_stream_passes_through_as_it_comes(remote):
    js, _, hosts = remote
    got: queue.Queue = queue.Queue()
    opened, stop = threading.Event(), threading.Event()
    reader = threading.Thread(target=read_events, args=(js, got, opened, stop), daemon=True)
    reader.start()
    assert opened.wait(30)
    api = Controller(js.forkd_url, js.token, timeout=120)
    kid = api.spawn_sandboxes("right", 1)[0]["id"]
    try:
        while True:  # the child's own event, with its host, before the stream ends or 30 s pass
            event = got.get(timeout=30)
            if event.get("id") == kid and event["action"] == "created":
                assert event["host"] == hosts[1].url
                break
    finally:
        stop.set()
        api.kill_sandbox(kid)  # an event, so the reader sees stop


def test_a_session_streams_through_to_the_sandbox_host(remote):
    js, _, _ = remote
    api = Controller(js.forkd_url, js.token, timeout=120)
    kid = api.spawn_sandboxes("right", 1)[0]["id"]
    try:
        printed = []
        with api.session(kid) as session:
            reply = session.execute("print('on', me)", on_event=lambda e: e.get("type") == "stream" and printed.append(
                e["text"]))
            assert reply["status"] == "ok" and "".join(printed) == "on 1\n"
        # a refusal before the upgrade keeps the remote's status and words
        with pytest.raises(ControllerError) as refused:
            api.session("sb-nope").__enter__()
        assert refused.value.status == 404 and "sb-nope" in refused.value.message
    finally:
        api.kill_sandbox(kid)


def test_the_mcp_route_acts_on_the_fleet(remote):
    """The MCP server stays in the Jupyter server; its tools call {base}forkd/v1, so they reach the fleet."""
    pytest.importorskip("mcp.server.mcpserver")
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    js, _, hosts = remote
    api = Controller(js.forkd_url, js.token, timeout=120)
    kid = api.spawn_sandboxes("right", 1)[0]["id"]

    async def listed():
        http = httpx2.AsyncClient(headers={"Authorization": f"token {js.token}"}, timeout=60)
        async with Client(streamable_http_client(js.mcp_url, http_client=http)) as client:
            result = await client.call_tool("list_sandboxes", {})
            assert not result.is_error, result.content[0].text
            value = result.structured_content
            # no controller in this server: eval_code goes through its routes to the fleet too
            evaluated = await client.call_tool("eval_code", {"sandbox_id": kid, "code": "6 * 7"})
            assert not evaluated.is_error, evaluated.content[0].text
            assert evaluated.structured_content["result"] == "42"
            return value["result"] if isinstance(value, dict) and set(value) == {"result"} else value

    try:
        assert {s["id"]: s.get("host") for s in asyncio.run(listed())}[kid] == hosts[1].url
    finally:
        api.kill_sandbox(kid)


async def bus_events(js: JupyterServer, act, want) -> dict:
    """The first forkd change on jupyter_server's event bus (what the Lab panel listens to) for which
    ``want`` holds, after ``act()``."""
    url = f"ws://127.0.0.1:{js.port}/api/events/subscribe"
    ws = await websocket.websocket_connect(httpclient.HTTPRequest(url, headers={"Authorization": f"token {js.token}"}))
    try:
        await asyncio.get_running_loop().run_in_executor(None, act)
        while True:
            message = await asyncio.wait_for(ws.read_message(), 30)
            assert message is not None, "the event bus closed"
            event = json.loads(message)
            if event.get("schema_id") == "https://events.jupyter.org/forkd/change/v1" and want(event):
                return event
    finally:
        ws.close()


def test_the_fleet_changes_reach_the_jupyter_event_bus(remote):
    js, _, hosts = remote
    api = Controller(js.forkd_url, js.token, timeout=120)
    made = []
    event = asyncio.run(bus_events(js, lambda: made.extend(api.spawn_sandboxes("left", 1)),
                                   lambda e: e.get("action") == "created" and e.get("kind") == "sandbox"))
    try:
        assert event["id"] == made[0]["id"] and event["host"] == hosts[0].url
    finally:
        api.kill_sandbox(made[0]["id"])


def test_a_remote_that_does_not_answer_is_said():
    dead = f"http://127.0.0.1:{free_port()}"
    js = JupyterServer(env={"FORKD_URL": dead, "FORKD_TOKEN": "x" * 20})
    try:
        status, body = call(js, "GET", "/forkd/v1/sandboxes")
        assert status == 502 and body["remote"] == dead
        assert dead in body["error"] and f"curl {dead}/healthz" in body["error"] and "FORKD_URL" in body["error"]
        assert call(js, "GET", "/forkd/version")[0] == 200  # the Lab extension's check still passes
    finally:
        js.stop()


def test_a_refused_token_names_the_setting(remote):
    _, router, _ = remote
    js = JupyterServer(env={"FORKD_URL": router.url, "FORKD_TOKEN": "not-the-routers-token"})
    try:
        status, body = call(js, "GET", "/forkd/v1/sandboxes")
        assert status == 502 and "refused this Jupyter server's token" in body["error"]
        assert "FORKD_TOKEN" in body["error"] and "not-the-routers-token" not in body["error"]
    finally:
        js.stop()


def test_a_remote_url_leading_back_to_itself_is_refused():
    port = free_port()
    js = JupyterServer(env={"FORKD_URL": f"http://127.0.0.1:{port}/forkd", "FORKD_TOKEN": ""}, port=port)
    try:
        status, body = call(js, "GET", "/forkd/v1/sandboxes")  # the second pass refuses it before its login check
        assert status == 508 and "leads back to this Jupyter server" in body["error"], body
    finally:
        js.stop()


def test_the_panels_check_out_runs_in_the_notebooks_kernel_here(remote):
    """The panel's Check out of a notebook whose forkd kernel this server runs (its HEAD on the
    fleet): run in that kernel here, not passed to the remote, whose server runs no such kernel."""
    js, _, _ = remote
    kernel = js.api("POST", "/api/kernels", {"name": "forkd-python"})["id"]
    kc = BlockingKernelClient(connection_file=os.path.join(js.workdir, "rt", f"kernel-{kernel}.json"))
    kc.load_connection_file()
    kc.start_channels(hb=False)  # the server watches the kernel's heartbeat
    api = Controller(js.forkd_url, js.token, timeout=120)
    try:
        kc.wait_for_ready(timeout=60)
        assert run(kc, "x = 21").ok
        assert run(kc, "kids = %forkd fork -n 1").ok
        head = api.get_kernel(kernel)["head"]
        (kid,) = [s["id"] for s in api.list_sandboxes() if s["id"] != head]
        assert run(kc, "x = 99").ok
        moved = api.checkout_kernel(kernel, kid)
        assert moved["head"] == kid and api.get_kernel(kernel)["head"] == kid
        assert run(kc, "x").result == "21"  # the next cell runs in the child
        with pytest.raises(ControllerError) as refused:  # the remote's 404, before the kernel is asked
            api.checkout_kernel(kernel, "sb-nope")
        assert refused.value.status == 404 and "sb-nope" in refused.value.message
    finally:
        kc.stop_channels()
        js.api("DELETE", f"/api/kernels/{kernel}")
        for s in api.list_sandboxes():
            api.kill_sandbox(s["id"])
        for s in sorted(api.list_snapshots(), key=lambda s: -len(s.get("lineage", []))):
            if s["tag"] not in ("left", "right"):
                api.delete_snapshot(s["tag"])


def test_the_event_relay_comes_back_after_the_router_restarts(remote):
    """Last in the module: it restarts the router. The Jupyter server reads the router's events again
    by itself (said in its log), and the next change reaches its event bus."""
    js, router, hosts = remote
    relaying = "relaying the change events of"
    assert js.output().count(relaying) == 1
    router.stop()
    router.start()
    router.wait(lambda h: h["hosts_up"] == 2, "see both hosts up again")
    deadline = time.monotonic() + 60  # the relay retries after 1, 2, 4... s
    while js.output().count(relaying) < 2:
        assert time.monotonic() < deadline, js.output()[-3000:]
        time.sleep(0.1)
    assert js.output().count("the panel is not kept live until") == 1  # the outage, said once
    api = Controller(js.forkd_url, js.token, timeout=120)
    made = []
    event = asyncio.run(bus_events(js, lambda: made.extend(api.spawn_sandboxes("right", 1)),
                                   lambda e: e.get("action") == "created" and e.get("kind") == "sandbox"))
    try:
        assert event["id"] == made[0]["id"] and event["host"] == hosts[1].url
    finally:
        api.kill_sandbox(made[0]["id"])
