"""Every /v1 route through jupyter-server (pytest_jupyter's jp_fetch) on real sandboxes.

Status codes, check order and error bodies follow reference/forkd-api.md.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

JSON = {"Content-Type": "application/json"}


async def call(jp_fetch, method, *parts, body=None, headers=None, params=None, prefix=("forkd", "v1")):
    hdrs = dict(JSON)
    hdrs.update(headers or {})
    if body is not None and not isinstance(body, (str, bytes)):
        body = json.dumps(body)
    r = await jp_fetch(*prefix, *parts, method=method, body=body, headers=hdrs, params=params, raise_error=False,
                       allow_nonstandard_methods=True)
    ctype = r.headers.get("Content-Type", "")
    return r.code, (json.loads(r.body) if r.body and ctype.startswith("application/json") else r.body)


@pytest.fixture
def snap(forkd_app):
    """Setup through the controller (the POST route itself is tested in test_create_snapshot)."""
    return forkd_app.controller.create_snapshot("py", setup="x = 41\nimport random")


@pytest.fixture
def sandbox(forkd_app, snap):
    return forkd_app.controller.spawn("py", 1)[0]


# --- meta ---------------------------------------------------------------------------------------

async def test_healthz_and_version(jp_fetch, forkd_app):
    code, health = await call(jp_fetch, "GET", "healthz", prefix=("forkd",))
    assert code == 200 and health["ok"] is True and set(health) == {"ok", "capacity"}  # tests/server/test_capacity.py
    code, body = await call(jp_fetch, "GET", "version", prefix=("forkd",))
    assert code == 200 and body["api"] == "v1" and body["version"]


async def test_metrics(jp_fetch, snap):
    code, kids = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py"})
    assert code == 201
    code, _ = await call(jp_fetch, "POST", "sandboxes", kids[0]["id"], "branch", body={"tag": "m1"})
    assert code == 201
    r = await jp_fetch("forkd", "metrics")
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = r.body.decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["forkd_snapshots_total"]) == 2  # py and m1
    assert float(lines["forkd_sandboxes_active"]) == 1
    assert float(lines["forkd_branches_in_flight"]) == 0
    assert float(lines["forkd_branch_concurrency_cap"]) == 4
    assert any(k.startswith('forkd_build_info{version="') and float(v) == 1 for k, v in lines.items())
    assert float(lines["forkd_spawn_seconds_count"]) == 1
    assert float(lines["forkd_branch_pause_seconds_count"]) == 1


async def test_metrics_registry_is_per_app(forkd_app):
    import prometheus_client

    assert forkd_app.metrics.registry is not prometheus_client.REGISTRY
    assert prometheus_client.REGISTRY.get_sample_value("forkd_sandboxes_active") is None


async def test_openapi_is_served(jp_fetch, forkd_app, jp_base_url):
    code, doc = await call(jp_fetch, "GET", "openapi.json")
    assert code == 200 and doc["openapi"].startswith("3.")
    assert doc["servers"] == [{"url": jp_base_url.rstrip("/") + "/forkd"}]
    assert "/v1/sandboxes/{id}/branch" in doc["paths"]


async def test_tree(jp_fetch, sandbox):
    code, nodes = await call(jp_fetch, "GET", "tree")
    assert code == 200
    by_id = {n["id"]: n for n in nodes}
    assert by_id["py"]["kind"] == "snapshot" and by_id["py"]["parent"] is None
    assert by_id[sandbox["id"]]["parent"] == "py"


# --- request bodies (checked before anything else) ----------------------------------------------

async def test_body_rules(jp_fetch, forkd_app):
    code, body = await call(jp_fetch, "POST", "sandboxes", body="{nope")
    assert code == 400 and body["error"].startswith("invalid JSON body")
    code, body = await call(jp_fetch, "POST", "sandboxes", body="")
    assert code == 400 and "empty" in body["error"]
    code, body = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py"},
                            headers={"Content-Type": "text/plain"})
    assert code == 415 and "application/json" in body["error"]
    code, body = await call(jp_fetch, "POST", "sandboxes", body={"n": 1})
    assert (code, body) == (422, {"error": "missing field `snapshot_tag`"})
    code, body = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py", "n": "2"})
    assert (code, body) == (422, {"error": "invalid type for field `n`: expected integer"})
    code, body = await call(jp_fetch, "POST", "sandboxes", body=[1, 2])
    assert code == 422
    # 422 comes before the sandbox lookup, as forkd's extractor does
    code, body = await call(jp_fetch, "POST", "sandboxes", "sb-nope", "exec", body={"args": "ls"})
    assert code == 422
    # unknown fields are ignored; null means absent
    code, body = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "nope", "extra": 1, "n": None})
    assert (code, body) == (404, {"error": "snapshot nope not found"})


# --- snapshots ----------------------------------------------------------------------------------

async def test_create_snapshot(jp_fetch, forkd_app):
    code, snap = await call(jp_fetch, "POST", "snapshots", body={"tag": "py", "setup": "x = 41"})
    assert code == 201
    assert snap["tag"] == "py" and snap["status"] == "ready" and snap["bootable"] is True
    assert "branched_from" not in snap and isinstance(snap["created_at_unix"], int)
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "py"})
    assert (code, body) == (400, {"error": "snapshot py already exists; DELETE first"})
    code, listed = await call(jp_fetch, "GET", "snapshots")
    assert code == 200 and [s["tag"] for s in listed] == ["py"]


async def test_create_snapshot_errors(jp_fetch, forkd_app):
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "-bad"})
    assert code == 400 and "invalid tag" in body["error"]
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "ok", "engine": "docker"})
    assert code == 400 and "engine must be one of" in body["error"]
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "ok", "setup_commands": "pip"})
    assert code == 422
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "ok", "setup": "raise SystemExit(3)"})
    assert code == 400 and body["error"] == ("snapshot ok: your setup code raised SystemExit: 3 (setup line 1)\n"
                                             "nothing was created: fix the setup and create the snapshot again")
    assert "setup line 1, in <module>" in body["details"]["traceback"]
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "ok", "setup_commands": [["false"]]})
    assert code == 400 and "setup command ['false'] exited 1" in body["error"]  # the request's fault, not a 500
    code, listed = await call(jp_fetch, "GET", "snapshots")
    assert listed == []  # a failed build leaves nothing behind


async def test_host_network_needs_the_servers_opt_in(jp_fetch, forkd_app, jp_http_port):
    body = {"tag": "hostnet", "host_network": True}
    code, reply = await call(jp_fetch, "POST", "snapshots", body=body)
    assert code == 403 and "--allow-host-network" in reply["error"] and "allow_host_network" in reply["error"]
    assert (await call(jp_fetch, "POST", "snapshots", body={**body, "host_network": False}))[0] == 201
    code, listed = await call(jp_fetch, "GET", "snapshots")
    assert [s["tag"] for s in listed] == ["hostnet"]  # the refused request made nothing
    await call(jp_fetch, "DELETE", "snapshots", "hostnet")
    forkd_app.allow_host_network = True  # as --ForkdApp.allow_host_network=True (forkd serve --allow-host-network)
    code, snap = await call(jp_fetch, "POST", "snapshots", body=body)
    assert code == 201, snap
    code, kids = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "hostnet"})
    reach = f"__import__('socket').create_connection(('127.0.0.1', {jp_http_port}), 5).getpeername()[1]"
    code, reply = await call(jp_fetch, "POST", "sandboxes", kids[0]["id"], "eval", body={"code": reach})
    assert (code, reply["result"]) == (200, str(jp_http_port)), reply  # what the opt-in allows: this server's port


async def test_create_snapshot_forkd_form(jp_fetch, forkd_app, tmp_path):
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "a/b", "kernel": "/nope"})
    assert code == 400 and "invalid tag" in body["error"]  # the tag is checked first
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "vm1", "kernel": "/nope/vmlinux",
                                                                 "rootfs": "/nope/rootfs.ext4"})
    assert (code, body) == (400, {"error": "kernel not found: /nope/vmlinux"})
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"")
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "vm1", "kernel": str(kernel),
                                                                 "rootfs": "/nope/rootfs.ext4"})
    assert (code, body) == (400, {"error": "rootfs not found: /nope/rootfs.ext4"})
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "vm1", "kernel": str(kernel),
                                                                 "rootfs": str(kernel), "boot_wait_secs": 61})
    assert (code, body) == (400, {"error": "boot_wait_secs must be at most 60"})


async def test_snapshot_info(jp_fetch, sandbox):
    code, info = await call(jp_fetch, "GET", "snapshots", "py", "info")
    assert code == 200
    assert info["tag"] == "py" and info["ancestors"] == [] and info["chain_depth"] == 0
    assert info["sandboxes"] == [sandbox["id"]]
    assert await call(jp_fetch, "GET", "snapshots", "nope", "info") == (404, {"error": "snapshot nope not found"})
    code, body = await call(jp_fetch, "GET", "snapshots", "..", "info")
    assert code in (400, 404)  # '..' is normalised away by URL handling or refused as a tag
    code, body = await call(jp_fetch, "GET", "snapshots", "-x", "info")
    assert code == 400 and "invalid tag" in body["error"]


async def test_delete_snapshot(jp_fetch, sandbox):
    code, _ = await call(jp_fetch, "POST", "sandboxes", sandbox["id"], "branch", body={"tag": "kid"})
    assert code == 201
    code, body = await call(jp_fetch, "DELETE", "snapshots", "py", params={"cascade": "true", "force": "true"})
    assert (code, body) == (400, {"error": "cascade and force are mutually exclusive"})
    code, body = await call(jp_fetch, "DELETE", "snapshots", "py", params={"cascade": "yes"})
    assert code == 400 and "cascade" in body["error"]
    assert await call(jp_fetch, "DELETE", "snapshots", "nope") == (404, {"error": "snapshot nope not found"})
    code, body = await call(jp_fetch, "DELETE", "snapshots", "-x")
    assert code == 400
    assert await call(jp_fetch, "DELETE", "snapshots", "py", params={"cascade": "true"}) == (204, b"")
    code, listed = await call(jp_fetch, "GET", "snapshots")
    assert listed == []  # the branch went with its ancestor


async def test_snapshot_packages_field(jp_fetch):
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "pk", "packages": "python3-numpy"})
    assert code == 422 and "packages" in body["error"]
    code, body = await call(jp_fetch, "POST", "snapshots",
                            body={"tag": "pk", "engine": "process", "packages": ["python3-numpy"]})
    assert code == 400 and "engine vm" in body["error"]
    code, body = await call(jp_fetch, "POST", "snapshots", body={"tag": "pk", "packages": ["Bad Name"]})
    assert code == 400 and "Debian package name" in body["error"]


# --- sandboxes ----------------------------------------------------------------------------------

async def test_spawn_and_list(jp_fetch, snap):
    code, kids = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py", "n": 3,
                                                                 "per_child_netns": False, "live_fork": True})
    assert code == 201 and len(kids) == 3
    fields = {"id", "snapshot_tag", "netns", "guest_addr", "created_at_unix", "pid", "memory_limit_mib",
              "has_branched", "last_branch_memory_path", "branch_count"}
    assert fields <= set(kids[0])
    assert all(k["id"].startswith("sb-") and k["snapshot_tag"] == "py" for k in kids)
    code, listed = await call(jp_fetch, "GET", "sandboxes")
    assert code == 200 and [s["id"] for s in listed] == sorted(k["id"] for k in kids)
    code, one = await call(jp_fetch, "GET", "sandboxes", kids[0]["id"])
    assert code == 200 and one["id"] == kids[0]["id"]
    # live state is never revalidated: no ETag is computed (a hash of every reply, for nothing)
    resp = await jp_fetch("forkd", "v1", "sandboxes", method="GET")
    assert "Etag" not in resp.headers


async def test_spawn_errors_in_forkd_order(jp_fetch, snap):
    assert await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py", "n": 0}) == \
        (400, {"error": "n must be at least 1"})
    code, body = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "-bad", "n": 1001})
    assert code == 400 and "1000" in body["error"]  # n is checked before the tag
    code, body = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "-bad"})
    assert code == 400 and "invalid snapshot_tag" in body["error"]
    assert await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "nope"}) == \
        (404, {"error": "snapshot nope not found"})
    code, body = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py", "n": -1})
    assert code == 422


async def test_unknown_sandbox_is_404_everywhere(jp_fetch, forkd_app):
    missing = {"error": "sandbox sb-nope not found"}
    assert await call(jp_fetch, "GET", "sandboxes", "sb-nope") == (404, missing)
    assert await call(jp_fetch, "DELETE", "sandboxes", "sb-nope") == (404, missing)
    assert await call(jp_fetch, "POST", "sandboxes", "sb-nope", "ping") == (404, missing)
    assert await call(jp_fetch, "POST", "sandboxes", "sb-nope", "exec", body={"args": []}) == (404, missing)
    assert await call(jp_fetch, "POST", "sandboxes", "sb-nope", "eval", body={"code": "1"}) == (404, missing)
    assert await call(jp_fetch, "POST", "sandboxes", "sb-nope", "run", body={"code": "1"}) == (404, missing)
    assert await call(jp_fetch, "POST", "sandboxes", "sb-nope", "branch", body={"tag": "t"}) == (404, missing)
    assert await call(jp_fetch, "GET", "sandboxes", "sb-nope", "memory") == (404, missing)
    assert await call(jp_fetch, "GET", "sandboxes", "sb-nope", "files", params={"path": "/"}) == (404, missing)


async def test_kill(jp_fetch, sandbox):
    sid = sandbox["id"]
    assert await call(jp_fetch, "DELETE", "sandboxes", sid) == (204, b"")
    assert (await call(jp_fetch, "GET", "sandboxes", sid))[0] == 404
    assert (await call(jp_fetch, "DELETE", "sandboxes", sid))[0] == 404
    assert await call(jp_fetch, "GET", "sandboxes") == (200, [])


async def test_a_sandbox_killed_by_its_memory_limit_says_so(jp_fetch, snap):
    code, kids = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py", "memory_limit_mib": 64})
    sid = kids[0]["id"]
    code, body = await call(jp_fetch, "POST", "sandboxes", sid, "eval", body={"code": "len(b'x' * (200 * 2**20))"})
    # what happened, then what to do: two lines; the kernel's counters and the fix in every front
    # end's words beside them, in details
    assert code == 410 and body["error"] == (f"sandbox {sid} ended during this eval: it died of its memory limit "
                                             f"(64 MiB)\nto go on, start a sandbox of py with a larger "
                                             f"memory_limit_mib, e.g. 128"), body
    assert "memory limit was reached (64 MiB)" in body["details"]["kernel"]
    assert body["details"]["rest"] == 'POST /v1/sandboxes {"snapshot_tag": "py", "memory_limit_mib": 128}'
    assert body["ended"] == {"at": body["ended"]["at"], "reason": "it died of its memory limit (64 MiB)",
                             "limit": "memory"}
    code, body = await call(jp_fetch, "GET", "sandboxes", sid)
    assert code == 404 and body["error"] == (f"sandbox {sid} not found: it died of its memory limit (64 MiB)\n"
                                             f"to go on, start a sandbox of py with a larger memory_limit_mib, "
                                             f"e.g. 128"), body
    assert "memory limit was reached (64 MiB)" in body["details"]["kernel"] and body["details"]["ended_at"]
    assert body["ended"]["limit"] == "memory" and body["ended"]["at"] > 0


async def test_ping_exec_eval_run(jp_fetch, sandbox):
    sid = sandbox["id"]
    r = await jp_fetch("forkd", "v1", "sandboxes", sid, "ping", method="POST", body=b"")  # no body, no type
    ping = json.loads(r.body)
    assert r.code == 200 and ping["pong"] is True and ping["sandbox_id"] == sid

    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "exec",
                           body={"args": ["/bin/sh", "-c", "echo $GREETING; echo err >&2; exit 3"],
                                 "timeout_secs": 10, "env": {"GREETING": "hi"}})
    assert code == 200 and (out["stdout"], out["stderr"], out["exit_code"]) == ("hi\n", "err\n", 3)
    assert await call(jp_fetch, "POST", "sandboxes", sid, "exec", body={"args": []}) == \
        (400, {"error": "args must be a non-empty list of strings"})
    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "exec", body={"args": ["/no/such/binary"]})
    assert code == 200 and out["exit_code"] != 0  # the agent's failure is a 200, as in forkd

    assert await call(jp_fetch, "POST", "sandboxes", sid, "eval", body={"code": "x + 1"}) == \
        (200, {"result": "42", "error": None, "exit_code": 0})
    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "eval", body={"code": "1/0"})
    assert code == 200 and out["result"] is None and out["exit_code"] == 1
    assert out["error"].startswith("ZeroDivisionError")

    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "run", body={"code": "y = x * 2\nprint('p')\ny"})
    assert code == 200 and out["stdout"] == "p\n" and out["result"]["text/plain"] == "82" and out["error"] is None
    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "eval", body={"code": "y"})
    assert out["result"] == "82"  # run_code state persists
    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "run", body={"code": "undefined_name"})
    assert code == 200 and out["error"]["ename"] == "NameError" and out["exit_code"] == 1


async def test_files(jp_fetch, sandbox):
    sid = sandbox["id"]
    r = await jp_fetch("forkd", "v1", "sandboxes", sid, "files", method="PUT", body=b"\x00binary\xff",
                       params={"path": "/tmp/d/data.bin"})
    assert r.code == 200 and json.loads(r.body)["size"] == 8
    code, out = await call(jp_fetch, "GET", "sandboxes", sid, "files", params={"path": "/tmp/d/data.bin"})
    assert code == 200 and base64.b64decode(out["data_b64"]) == b"\x00binary\xff" and out["truncated"] is False
    r = await jp_fetch("forkd", "v1", "sandboxes", sid, "files", method="PUT", body=b"more",
                       params={"path": "/tmp/d/data.bin", "append": "true"})
    assert json.loads(r.body)["size"] == 12
    code, out = await call(jp_fetch, "GET", "sandboxes", sid, "files", params={"path": "/tmp/d"})
    assert code == 200 and [e["name"] for e in out["entries"]] == ["data.bin"]
    assert out["entries"][0]["type"] == "file"
    code, out = await call(jp_fetch, "GET", "sandboxes", sid, "files", params={"path": "/tmp/nope"})
    assert code == 404 and "/tmp/nope" in out["error"]
    code, out = await call(jp_fetch, "GET", "sandboxes", sid, "files")
    assert code == 400 and "path" in out["error"]
    code, out = await call(jp_fetch, "DELETE", "sandboxes", sid, "files", params={"path": "/tmp/d"})
    assert code == 400 and "recursive" in out["error"]
    assert await call(jp_fetch, "DELETE", "sandboxes", sid, "files", params={"path": "/tmp/d", "recursive": "true"}) \
        == (204, b"")
    assert (await call(jp_fetch, "GET", "sandboxes", sid, "files", params={"path": "/tmp/d/data.bin"}))[0] == 404
    # the file the API wrote is the file the sandbox sees
    await jp_fetch("forkd", "v1", "sandboxes", sid, "files", method="PUT", body=b"7", params={"path": "/tmp/n.txt"})
    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "eval", body={"code": "int(open('/tmp/n.txt').read()) * 6"})
    assert out["result"] == "42"


async def test_memory(jp_fetch, sandbox):
    code, mem = await call(jp_fetch, "GET", "sandboxes", sandbox["id"], "memory")
    assert code == 200 and mem["pss_kib"] > 0 and mem["rss_kib"] >= mem["pss_kib"]


# --- branch -------------------------------------------------------------------------------------

async def test_branch_full_and_grandchildren(jp_fetch, sandbox):
    sid = sandbox["id"]
    await call(jp_fetch, "POST", "sandboxes", sid, "run", body={"code": "x = 'branched state'"})
    code, info = await call(jp_fetch, "POST", "sandboxes", sid, "branch", body={"tag": "b1"})
    assert code == 201
    assert info["tag"] == "b1" and info["status"] == "ready" and info["bootable"] is True
    assert info["branched_from"] == sid and info["pause_ms"] >= 0
    code, kids = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "b1", "n": 2})
    assert code == 201
    for kid in kids:
        assert (await call(jp_fetch, "POST", "sandboxes", kid["id"], "eval", body={"code": "x"}))[1]["result"] == \
            "'branched state'"
    code, src = await call(jp_fetch, "GET", "sandboxes", sid)
    assert src["branch_count"] == 1 and src["has_branched"] is True
    # the same tag again: 409
    code, body = await call(jp_fetch, "POST", "sandboxes", sid, "branch", body={"tag": "b1"})
    assert (code, body) == (409, {"error": "snapshot b1 already exists; DELETE first"})


def test_pause_fields_round_up_and_keep_microseconds():
    from forkd_server.controller.wire import pause_fields

    assert pause_fields(2.26) == {"pause_ms": 3, "pause_us": 2260}
    assert pause_fields(2.0) == {"pause_ms": 2, "pause_us": 2000}
    assert pause_fields(0.0004) == {"pause_ms": 1, "pause_us": 1}   # a real pause is never 0
    assert pause_fields(None) == {}


async def test_pause_ms_is_an_integer_everywhere_on_the_wire(jp_fetch, jp_http_port, jp_base_url, jp_auth_header,
                                                              forkd_app, sandbox):
    """forkd types pause_ms as an unsigned integer (a serde u64 client rejects 2.26); pause_us is precise."""
    from .test_events import _next_events, _open_sse

    def integral(info):
        assert type(info["pause_ms"]) is int and type(info["pause_us"]) is int, info
        assert info["pause_ms"] >= 1 and info["pause_ms"] == -(-info["pause_us"] // 1000), info
        return info["pause_ms"], info["pause_us"]

    reader, writer = await _open_sse(jp_http_port, f"{jp_base_url}forkd/v1/events", jp_auth_header)
    try:
        code, reply = await call(jp_fetch, "POST", "sandboxes", sandbox["id"], "branch", body={"tag": "pz"})
        events = await _next_events(reader, 2)
    finally:
        writer.close()
    assert code == 201
    pause = integral(reply)
    created = next(e for e in events if e["action"] == "created" and e["tag"] == "pz")
    assert integral(created) == pause
    listed = next(s for s in (await call(jp_fetch, "GET", "snapshots"))[1] if s["tag"] == "pz")
    assert integral(listed) == pause
    assert integral((await call(jp_fetch, "GET", "snapshots", "pz", "info"))[1]) == pause
    node = next(n for n in (await call(jp_fetch, "GET", "tree"))[1] if n["id"] == "pz")
    assert integral(node) == pause
    # the registry and the metrics keep the engine's precise figure
    precise = forkd_app.controller.registry.get_snapshot("pz")["pause_ms"]
    assert round(precise * 1000) == pause[1]
    text = (await jp_fetch("forkd", "metrics")).body.decode()
    total = float(next(line.split()[1] for line in text.splitlines()
                       if line.startswith("forkd_branch_pause_seconds_sum")))
    assert total == pytest.approx(precise / 1000, abs=1e-6)


async def test_branch_default_tag_and_empty_body(jp_fetch, sandbox):
    code, info = await call(jp_fetch, "POST", "sandboxes", sandbox["id"], "branch", body={})
    assert code == 201 and info["tag"].startswith(f"branch-{sandbox['id']}-")


async def test_branch_live_no_wait_is_202(jp_fetch, forkd_app, sandbox):
    code, info = await call(jp_fetch, "POST", "sandboxes", sandbox["id"], "branch",
                            body={"tag": "lv", "mode": "live", "wait": False})
    assert code == 202 and info["tag"] == "lv" and info["branched_from"] == sandbox["id"]
    assert info["status"] in ("writing", "ready")
    done = await asyncio.to_thread(forkd_app.controller.wait_snapshot, "lv", 30)
    assert done["status"] == "ready"
    code, info = await call(jp_fetch, "POST", "sandboxes", sandbox["id"], "branch",
                            body={"tag": "lv2", "live": True})
    assert code == 201 and info["status"] == "ready"


async def test_branch_check_order(jp_fetch, forkd_app, sandbox):
    sid = sandbox["id"]
    branch = ("sandboxes", sid, "branch")
    code, body = await call(jp_fetch, "POST", *branch, body={"tag": "../x"})
    assert code == 400 and "invalid tag" in body["error"]
    code, body = await call(jp_fetch, "POST", *branch, body={"tag": "t", "mode": "live", "diff": True})
    assert (code, body) == (400, {"error": "mode cannot be combined with diff or live"})
    code, body = await call(jp_fetch, "POST", *branch, body={"tag": "t", "diff": True, "measure_diff": True})
    assert code == 400 and "only one of" in body["error"]
    code, body = await call(jp_fetch, "POST", *branch, body={"tag": "t", "wait": False})
    assert code == 400 and "live" in body["error"]
    code, body = await call(jp_fetch, "POST", *branch, body={"tag": "t", "parent_tag": "other", "diff": True})
    assert code == 400 and "parent_tag" in body["error"]
    code, body = await call(jp_fetch, "POST", *branch, body={"tag": "t", "parent_tag": "py"})
    assert (code, body) == (400, {"error": "parent_tag needs diff mode"})
    # a valid body for a missing sandbox is 404, not 400
    code, body = await call(jp_fetch, "POST", "sandboxes", "sb-nope", "branch", body={"tag": "t", "mode": "full"})
    assert code == 404
    # the concurrency slot is taken before mode validation: 409 for a tag in flight, 503 at the cap
    ctl = forkd_app.controller
    release = ctl.branches.take_slot("busy")
    try:
        code, body = await call(jp_fetch, "POST", *branch, body={"tag": "busy", "mode": "live", "diff": True})
        assert code == 409 and "in flight" in body["error"]
    finally:
        release()
    releases = [ctl.branches.take_slot(f"held-{i}") for i in range(ctl.branch_cap)]
    try:
        code, body = await call(jp_fetch, "POST", *branch, body={"tag": "t", "mode": "live", "diff": True})
        assert code == 503 and "concurrency" in body["error"]
        code, body = await call(jp_fetch, "POST", "sandboxes", "sb-nope", "branch", body={"tag": "t"})
        assert code == 503  # a busy server answers 503 even for a missing sandbox
    finally:
        for release in releases:
            release()
    code, _ = await call(jp_fetch, "POST", *branch, body={"tag": "t", "mode": "diff"})
    assert code == 201


async def test_spawn_from_writing_snapshot_is_409(jp_fetch, forkd_app, snap):
    forkd_app.controller.registry.update_snapshot("py", status="writing")
    try:
        code, body = await call(jp_fetch, "POST", "sandboxes", body={"snapshot_tag": "py"})
        assert code == 409 and body["error"].startswith("snapshot `py` is not bootable: status=writing")
    finally:
        forkd_app.controller.registry.update_snapshot("py", status="ready")
