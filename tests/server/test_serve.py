"""Full stack: ``forkd serve`` as a real subprocess, driven by the client SDK and the ``forkd`` CLI."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request

import pytest

from forkd_server.client import Controller, ControllerError, Sandbox, Snapshot

from ..serving import FORKD, Server, free_port, refusals

@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="fk")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def token_file(workdir):
    path = os.path.join(workdir, "token")
    with open(path, "w") as f:
        f.write(secrets.token_hex(20) + "\n")
    return path


def cli(server, *args: str, token: str | None = None, check: bool = True, url: str | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}
    env.update(FORKD_URL=url or server.url, FORKD_TOKEN=token if token is not None else server.token)
    done = subprocess.run([*FORKD, *args], capture_output=True, text=True, env=env, timeout=120)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


# --- the SDK ------------------------------------------------------------------------------------

def test_sdk_snapshot_fork_branch_grandchildren(ctl):
    snap = Snapshot.create("sdk", controller=ctl, setup="import random\nbase = [1, 2, 3]")
    assert snap.status == "ready" and snap.tag == "sdk"
    kids = snap.fork(2)
    assert len(kids) == 2 and all(isinstance(k, Sandbox) for k in kids)
    with kids[0] as sb:
        assert sb.ping()["pong"] is True
        result = sb.commands.run("echo $((6 * 7))")
        assert (result.stdout, result.exit_code) == ("42\n", 0)
        assert sb.commands.run(["/bin/sh", "-c", "exit 4"]).exit_code == 4
        sb.files.write("/tmp/notes.txt", "hello")
        assert sb.files.read("/tmp/notes.txt") == "hello"
        assert sb.files.read("/tmp/notes.txt", format="bytes") == b"hello"
        assert "notes.txt" in [e["name"] for e in sb.files.list("/tmp")]
        assert sb.files.exists("/tmp/notes.txt") and not sb.files.exists("/tmp/none")
        run = sb.run_code("base.append(4)\nprint('appended')\nsum(base)")
        assert (run.stdout, run.text, run.error) == ("appended\n", "10", None)
        assert sb.eval("len(base)") == "4"
        with pytest.raises(RuntimeError, match="forkd eval: NameError"):
            sb.eval("nope")
        child = sb.branch("sdk-b", mode="live", wait=False)
        assert child.branched_from == sb.id and isinstance(child.pause_ms, int) and child.pause_ms >= 1
        assert child.pause_ms == -(-child.pause_us // 1000)  # pause_us: the precise figure
        child.wait(30)
        assert child.status == "ready"
        grandkids = child.fork(2)
        assert [g.eval("base") for g in grandkids] == ["[1, 2, 3, 4]"] * 2
        assert kids[1].eval("base") == "[1, 2, 3]"  # the sibling is untouched
        for g in grandkids:
            g.kill()
    # `with` killed it
    with pytest.raises(ControllerError) as info:
        ctl.get_sandbox(kids[0].id)
    assert info.value.status == 404
    kids[1].kill()
    details = child.details()
    assert details["ancestors"] == ["sdk", kids[0].id]
    snap.delete(cascade=True)
    assert [s["tag"] for s in ctl.list_snapshots() if s["tag"].startswith("sdk")] == []


def test_sdk_forkd_method_names(ctl):
    ctl.create_snapshot("names")
    kid = ctl.spawn_sandboxes("names", n=1)[0]
    assert ctl.ping_sandbox(kid["id"])["pong"] is True
    assert ctl.exec_command(kid["id"], ["python3", "-c", "print(2+2)"]) == {"stdout": "4\n", "stderr": "", "exit_code": 0}
    assert ctl.eval_code(kid["id"], "1+1") == {"result": "2", "error": None, "exit_code": 0}
    info = ctl.branch_sandbox(kid["id"], tag="names-b", mode="diff")
    assert info["status"] == "ready" and info["branched_from"] == kid["id"]
    assert [s["id"] for s in ctl.list_sandboxes()] == [kid["id"]]
    assert ctl.get_sandbox(kid["id"])["branch_count"] == 1
    assert ctl.kill_sandbox(kid["id"]) is None
    with pytest.raises(ControllerError) as info:
        ctl.delete_snapshot("names")  # its branch depends on nothing; still there -> 204
        ctl.delete_snapshot("names")
    assert info.value.status == 404
    ctl.delete_snapshot("names-b")


def test_sdk_events_stream(ctl):
    ctl.create_snapshot("evs")
    stream = ctl.events(timeout=20)
    try:
        kid = ctl.spawn_sandboxes("evs")[0]
        event = next(stream)
        assert (event["kind"], event["action"], event["id"]) == ("sandbox", "created", kid["id"])
        ctl.kill_sandbox(kid["id"])
        event = next(stream)
        assert (event["kind"], event["action"], event["id"]) == ("sandbox", "killed", kid["id"])
    finally:
        stream.close()
    ctl.delete_snapshot("evs")


def test_sdk_wrong_token(server):
    with pytest.raises(ControllerError) as info:
        Controller(server.url, "wrong-token-wrong-token").list_sandboxes()
    assert (info.value.status, info.value.body) == (401, {"error": "invalid bearer token"})
    with pytest.raises(ControllerError) as info:
        Controller(server.url, "").list_sandboxes()
    assert (info.value.status, info.value.body) == (401, {"error": "missing bearer token"})
    assert Controller(server.url, "").healthz() == {"ok": True}  # public: up, and nothing of its load
    assert Controller(server.url, "wrong-token-wrong-token").healthz() == {"ok": True}
    health = Controller(server.url, server.token).healthz()  # a router's heartbeat, with a token
    assert health["ok"] is True and set(health["capacity"]) == {"memory_free", "sandboxes", "max_sandboxes",
                                                                "snapshots", "load"}


def test_sdk_and_cli_find_the_running_server(server, monkeypatch):
    """No FORKD_URL / FORKD_TOKEN: the server is found from Jupyter's runtime files, token included."""
    for name in ("FORKD_URL", "FORKD_TOKEN", "JPY_PARENT_PID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", server.runtime_dir)
    ctl = Controller()
    assert (ctl.base_url, ctl.token) == (server.url, server.token)
    assert ctl.list_sandboxes() == []
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}
    done = subprocess.run([*FORKD, "ls", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, json.loads(done.stdout or "null")) == (0, []), done.stderr


def _fetch(url: str, token: str | None, method: str = "GET", data: bytes | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("method,path", [
    ("GET", "/files/registry.sqlite3"), ("GET", "/files/"), ("POST", "/api/shutdown"), ("GET", "/api/me"),
    ("GET", "/api/status"), ("GET", "/api"), ("GET", "/api/contents"), ("POST", "/api/kernels"),
    ("GET", "/api/kernelspecs"), ("GET", "/api/events"), ("GET", "/api/sessions"), ("GET", "/login"),
    ("GET", "/logout"), ("GET", "/static/style/index.css"), ("GET", "/tree"), ("GET", "/lab"),
    ("PUT", "/api/contents/x.txt"),
])
@pytest.mark.parametrize("with_token", [True, False], ids=["token", "no-token"])
def test_only_forkds_routes_are_served(server, method, path, with_token):
    """None of jupyter-server's own handlers: the data dir (its registry, a VM's disks) is never a file
    route, no shutdown, no identity or status API, no pages (the audit found all of these)."""
    assert os.path.exists(os.path.join(server.data_dir, "registry.sqlite3"))  # there, and not served
    code, body = _fetch(server.url + path, server.token if with_token else None, method,
                        b"{}" if method in ("POST", "PUT") else None)
    assert code == 404, (method, path, code, body[:200])
    assert json.loads(body)["error"].startswith("not found: forkd serve answers /healthz")
    assert server.proc.poll() is None  # POST /api/shutdown did not stop it


def test_metrics_are_forkds_own(server):
    code, body = _fetch(server.url + "/metrics", server.token)
    assert code == 200 and b"forkd_build_info" in body and b"forkd_long_calls_running" in body


def test_no_token_in_the_log(server):
    """tornado logs each 4xx with its URI: a ?token= must not reach the log in clear."""
    wrong = "wrong-" + secrets.token_hex(12)
    assert _fetch(f"{server.url}/v1/sandboxes?token={wrong}", None)[0] == 401
    assert _fetch(f"{server.url}/v1/sandboxes/sb-none?token={server.token}", None)[0] == 404
    assert _fetch(f"{server.url}/v1/nothing?a=1&token={server.token}", None)[0] == 404
    assert _fetch(f"{server.url}/files/x?token={server.token}", None)[0] == 404
    # a request is logged after its answer is sent: read the log once the last one is in it
    deadline = time.monotonic() + 30
    while "GET /files/x?token=[secret]" not in (log := server.output()):  # a path outside the API too
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.05)
    assert "GET /v1/sandboxes/sb-none?token=[secret]" in log  # the request is logged, the token is not
    assert wrong not in log and server.token not in log


def test_host_network_is_refused_without_the_opt_in(ctl):
    with pytest.raises(ControllerError) as info:
        ctl.create_snapshot("hostnet", host_network=True)
    assert info.value.status == 403 and "forkd serve --allow-host-network" in str(info.value)
    assert "hostnet" not in [s["tag"] for s in ctl.list_snapshots()]


def test_allow_host_network_reaches_the_extension():
    from forkd_server.serve import build_argv
    assert "--ForkdApp.allow_host_network=True" in build_argv(no_token=True, allow_host_network=True)[0]
    assert not any("allow_host_network" in a for a in build_argv(no_token=True)[0])


@pytest.mark.parametrize("store, said", [("ftp://host/x", "unknown scheme 'ftp'"), ("s3:/bucket", "names no bucket")])
def test_a_store_url_that_names_no_store_is_one_line_before_the_server_starts(store, said, workdir):
    done = subprocess.run([*FORKD, "serve", "--port", str(free_port()), "--data-dir", os.path.join(workdir, "badstore"),
                           "--store", store], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"forkd serve: --store: store {store!r}")
    assert said in done.stderr
    assert "Traceback" not in done.stderr and "listening" not in done.stderr


def test_a_port_in_use_is_one_line_saying_what_to_do(workdir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([*FORKD, "serve", "--port", str(port), "--data-dir", os.path.join(workdir, "portinuse")],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (f"forkd serve: 127.0.0.1:{port} is already in use by another process: pass "
                                            f"--port N (if it is another forkd serve, `forkd ls --url "
                                            f"http://127.0.0.1:{port}` reaches it)")


def test_store_timeout_reaches_the_extension_and_a_bad_one_is_refused():
    from forkd_server.serve import ServeError, build_argv
    assert "--ForkdApp.store_timeout=300.0" in build_argv(no_token=True, store_timeout=300.0)[0]
    assert not any("store_timeout" in a for a in build_argv(no_token=True)[0])
    for bad in (0.0, -5.0, float("nan")):
        with pytest.raises(ServeError, match="--store-timeout must be a number of seconds above 0"):
            build_argv(no_token=True, store_timeout=bad)


# --- the CLI ------------------------------------------------------------------------------------

def test_cli_round_trip(server, ctl):
    out = cli(server, "snapshot", "--tag", "cli", "--setup", "v = 7", "--json")
    assert json.loads(out.stdout)["status"] == "ready"
    kids = json.loads(cli(server, "spawn", "--tag", "cli", "-n", "2", "--json").stdout)
    assert len(kids) == 2
    listed = json.loads(cli(server, "ls", "--json").stdout)
    assert sorted(k["id"] for k in kids) == [b["id"] for b in listed]
    table = cli(server, "ls").stdout
    assert kids[0]["id"] in table and "sandbox" in table
    sid = kids[0]["id"]
    done = cli(server, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3", check=False)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    assert cli(server, "eval", sid, "v * 6").stdout.strip() == "42"
    assert "pong from " + sid in cli(server, "ping", sid).stdout
    assert cli(server, "run", sid, "w = v + 1\nw").stdout.strip() == "8"
    branch = json.loads(cli(server, "snapshot", "--from-sandbox", sid, "--tag", "cli-b", "--live", "--no-wait",
                            "--json").stdout)
    assert branch["branched_from"] == sid and branch["status"] in ("writing", "ready")
    ctl.wait_snapshot("cli-b", 30)
    info = json.loads(cli(server, "snapshot-info", "cli-b", "--json").stdout)
    assert info["ancestors"] == ["cli", sid]
    snaps = json.loads(cli(server, "ls", "--snapshots", "--json").stdout)
    assert {"cli", "cli-b"} <= {s["tag"] for s in snaps}
    pause_us = next(s for s in snaps if s["tag"] == "cli-b")["pause_us"]
    assert f"{pause_us / 1000:.2f} ms" in cli(server, "ls", "--snapshots").stdout  # the table shows the precise pause
    killed = json.loads(cli(server, "kill", "--tag", "cli", "--reason", "the sweep is over", "--json").stdout)
    assert sorted(killed["killed"]) == sorted(k["id"] for k in kids)
    done = cli(server, "eval", sid, "1", check=False)  # what a later call says
    assert done.returncode == 1 and f"sandbox {sid} not found: the sweep is over" in done.stderr
    assert json.loads(cli(server, "ls", "--json").stdout) == []
    done = cli(server, "rmi", "cli", "--cascade", "--force", check=False)
    assert done.returncode != 0 and "mutually exclusive" in done.stderr
    assert json.loads(cli(server, "rmi", "cli", "--cascade", "--json").stdout) == {"removed": ["cli"], "failed": {}}
    assert [s for s in json.loads(cli(server, "ls", "-s", "--json").stdout) if s["tag"].startswith("cli")] == []


def test_cli_snapshot_limits_and_labels(server, ctl):
    slow = cli(server, "snapshot", "--tag", "cli-slow", "--setup", "import time; time.sleep(600)",
               "--setup-timeout-secs", "2", check=False)
    assert slow.returncode == 1 and "did not finish within 2 s" in slow.stderr, slow.stderr
    assert one_line(slow).endswith("; nothing was created: give it longer with setup_timeout_secs, and create the "
                                   "snapshot again: --setup-timeout-secs S\n")
    big = cli(server, "snapshot", "--tag", "cli-big", "--setup", "blob = bytearray(400 * 2**20)",
              "--memory-limit-mib", "128", check=False)
    assert big.returncode == 1 and "memory limit was reached" in big.stderr and "128 MiB" in big.stderr, big.stderr
    assert {"cli-slow", "cli-big"}.isdisjoint(s["tag"] for s in ctl.list_snapshots())

    snap = json.loads(cli(server, "snapshot", "--tag", "cli-lab", "--label", "team=ml", "--label", "step=1",
                          "--json").stdout)
    assert snap["labels"] == {"team": "ml", "step": "1"}
    (kid,) = json.loads(cli(server, "spawn", "-t", "cli-lab", "--label", "who=me", "--json").stdout)
    assert kid["labels"] == {"team": "ml", "step": "1", "who": "me"}   # the snapshot's, then its own
    (whole,) = json.loads(cli(server, "spawn", "-t", "cli-lab", "--memory-limit-mib", "host", "--json").stdout)
    from forkd_server.controller.checks import host_memory_mib
    assert whole["memory_limit_mib"] == host_memory_mib()  # "host": all of the server's host's memory
    ctl.kill_sandbox(whole["id"])
    lots = cli(server, "spawn", "-t", "cli-lab", "--memory-limit-mib", "lots", check=False)
    assert lots.returncode == 2 and "'lots' is neither a whole number of MiB nor \"host\"" in lots.stderr, lots.stderr
    other = ctl.spawn_sandboxes("cli-lab", 1)[0]
    branch = json.loads(cli(server, "snapshot", "--from-sandbox", kid["id"], "--tag", "cli-lab-b", "--label", "step=2",
                            "--json").stdout)
    assert branch["labels"] == {"team": "ml", "step": "2", "who": "me"}
    assert [b["id"] for b in json.loads(cli(server, "ls", "--label", "who=me", "--json").stdout)] == [kid["id"]]
    assert [s["tag"] for s in json.loads(cli(server, "ls", "-s", "--label", "step=2", "--json").stdout)] == ["cli-lab-b"]

    bad = cli(server, "snapshot", "--tag", "cli-x", "--label", "novalue", check=False)
    assert bad.returncode != 0 and "--label takes KEY=VALUE" in bad.stderr
    bad = cli(server, "snapshot", "--from-sandbox", kid["id"], "--memory-limit-mib", "256", check=False)
    assert bad.returncode != 0 and "takes no --memory-limit-mib" in bad.stderr
    forkds = cli(server, "snapshot", "--tag", "cli-vm", "--kernel", "/nonexistent/vmlinux", "--rootfs", "/x",
                 check=False)  # forkd's form reaches the server as forkd sends it
    assert forkds.returncode == 1 and "kernel not found: /nonexistent/vmlinux" in forkds.stderr
    for sb in (kid["id"], other["id"]):
        ctl.kill_sandbox(sb)
    ctl.delete_snapshot("cli-lab", cascade=True)


def test_cli_compact_and_workspaces(server, ctl):
    ctl.create_snapshot("cliw", setup="v = 1")
    copy = json.loads(cli(server, "snapshot-compact", "--from", "cliw", "--to", "cliw-copy", "--json").stdout)
    assert (copy["tag"], copy["branched_from"], copy["status"]) == ("cliw-copy", "compact:cliw", "ready")
    assert "compact:cliw" in cli(server, "ls", "--snapshots").stdout

    ws = json.loads(cli(server, "workspace", "create", "wcli", "--snapshot", "cliw", "--memory-limit-mib", "256",
                        "--json").stdout)
    assert ws["status"] == "running" and ws["memory_limit_mib"] == 256
    ctl.run_code(ws["live_sandbox_id"], "v = 2")
    info = json.loads(cli(server, "workspace", "suspend", "wcli", "--diff", "--json").stdout)
    assert (info["status"], info["current_state_tag"]) == ("suspended", "ws-wcli-state")
    table = cli(server, "workspace", "list").stdout
    assert "wcli" in table and "suspended" in table and "ws-wcli-state" in table
    assert [w["name"] for w in json.loads(cli(server, "workspace", "ls", "--json").stdout)] == ["wcli"]
    done = cli(server, "workspace", "suspend", "wcli", check=False)
    assert done.returncode == 1 and "workspace wcli is not running (status suspended) (HTTP 400)" in done.stderr
    info = json.loads(cli(server, "workspace", "resume", "wcli", "--json").stdout)
    assert info["status"] == "running" and ctl.eval_code(info["live_sandbox_id"], "v")["result"] == "2"
    assert "running" in cli(server, "workspace", "resume", "wcli", check=False).stderr
    assert json.loads(cli(server, "workspace", "delete", "wcli", "--json").stdout) == {"deleted": "wcli"}
    done = cli(server, "workspace", "rm", "wcli", check=False)
    assert done.returncode == 1 and "workspace wcli not found" in done.stderr
    assert ctl.list_workspaces() == []
    ctl.delete_snapshot("cliw")
    ctl.delete_snapshot("cliw-copy")


def one_line(done) -> str:
    """The CLI said its failure in one line on stderr, no traceback, and exited non-zero."""
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    return done.stderr


def test_cli_errors_are_one_line_and_a_status(server, ctl):
    said = one_line(cli(server, "spawn", "-t", "nope", "-n", "0", check=False))  # 400
    assert said == "forkd spawn: n must be at least 1 (HTTP 400)\n"
    said = one_line(cli(server, "ping", "sb-nope", check=False))  # 404
    assert said == "forkd ping: sandbox sb-nope not found (HTTP 404); check the name: forkd ls lists the sandboxes\n"
    snap = ctl.create_snapshot("cli-err")
    (sb,) = ctl.spawn_sandboxes("cli-err", 1)
    ctl.run_code(sb["id"], "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()")
    done = cli(server, "snapshot", "--from-sandbox", sb["id"], check=False)  # 409, with details
    said = one_line(done)
    assert said.startswith(f"forkd snapshot: branch of {sb['id']} would lose what a fork() cannot carry: ")
    assert said.endswith("(HTTP 409); use the VM engine, which carries it, or fork anyway with a lossy fork: "
                         "forkd snapshot --lossy\n") and done.returncode == 1
    debug = cli(server, "snapshot", "--from-sandbox", sb["id"], "--debug", check=False)  # the details, the traceback
    assert debug.returncode == 1 and debug.stderr.startswith(said)
    assert "\n  sdk: lossy=True\n" in debug.stderr and "\n  cli: forkd snapshot --lossy\n" in debug.stderr
    assert "Traceback (most recent call last)" in debug.stderr and "ControllerError" in debug.stderr
    as_json = json.loads(cli(server, "snapshot", "--from-sandbox", sb["id"], "--json", check=False).stdout)
    assert as_json["status"] == 409 and as_json["details"]["lost"] and "\nuse the VM engine" in as_json["error"]
    ctl.kill_sandbox(sb["id"])
    ctl.delete_snapshot(snap["tag"])

    port = free_port()  # nothing answers there
    done = cli(server, "ls", url=f"http://127.0.0.1:{port}", check=False)
    said = one_line(done)
    assert done.returncode == 2 and said.startswith(f"forkd ls: no forkd server answers at http://127.0.0.1:{port} (")
    assert said.endswith("; start one with `forkd serve`, or point FORKD_URL (and FORKD_TOKEN) at a running one\n")
    env = {**os.environ, "FORKD_URL": f"http://127.0.0.1:{port}", "FORKD_DEBUG": "1"}
    debug = subprocess.run([*FORKD, "ls"], capture_output=True, text=True, env=env, timeout=60)
    assert debug.returncode == 2 and debug.stderr.startswith(said) and "Traceback" in debug.stderr

    said = one_line(cli(server, "ls", token="wrong-token-wrong-token", check=False))  # 401
    assert "invalid bearer token (HTTP 401); set FORKD_TOKEN (or --token)" in said
    said = one_line(cli(server, "spawn", check=False))  # a bad argument: argparse's words, in one line
    assert said == "forkd spawn: the following arguments are required: --tag/-t (see forkd spawn --help)\n"
    done = cli(server, "snapshot", "--from-sandbox", "sb-x", "--diff", "--live", check=False)
    assert done.returncode == 2 and "not allowed with" in one_line(done)
    assert "--from-sandbox" in one_line(cli(server, "snapshot", "--tag", "x", "--no-wait", check=False))
    done = cli(server, "kill", "sb-nope", check=False)  # a bulk command's failed item: on stderr, as any failure
    assert done.returncode == 1 and done.stdout == "killed 0 sandbox(es)\n"
    assert done.stderr == ("forkd kill: sb-nope: sandbox sb-nope not found; check the name: forkd ls lists the "
                           "sandboxes\n")
    done = cli(server, "rmi", "no-such-tag", check=False)
    assert done.returncode == 1 and done.stdout == "" and done.stderr.startswith(
        "forkd rmi: no-such-tag: snapshot no-such-tag not found; check the name: forkd ls --snapshots")


def test_cli_says_what_to_do_about_forkds_bare_messages(server, ctl):
    """forkd's wire keeps its messages word for word ('snapshot X not found', '... DELETE first'); the
    CLI adds what to do, in its own words."""
    said = one_line(cli(server, "spawn", "-t", "no-such-tag", check=False))
    assert said == ("forkd spawn: snapshot no-such-tag not found (HTTP 404); check the name: forkd ls --snapshots "
                    "lists the snapshots\n")
    said = one_line(cli(server, "workspace", "delete", "no-such-ws", check=False))
    assert said.endswith("(HTTP 404); check the name: forkd workspace list lists the workspaces\n")
    ctl.create_snapshot("cli-taken")
    said = one_line(cli(server, "snapshot", "--tag", "cli-taken", "--setup", "x = 1", check=False))
    assert said == ("forkd snapshot: snapshot cli-taken already exists (HTTP 400); choose another tag, or delete that "
                    "snapshot first: forkd rmi cli-taken\n")
    ctl.delete_snapshot("cli-taken")


def test_cli_hint_for_the_fleets_not_found(capsys):
    from forkd_server.cli._errors import report
    error = ControllerError(404, {"error": "sandbox sb-x not found on any host of the fleet"}, "http://r/v1/sandboxes/sb-x")
    assert report("ping", error, debug=False, as_json=False) == 1
    assert capsys.readouterr().err == ("forkd ping: sandbox sb-x not found on any host of the fleet (HTTP 404); check "
                                       "the name: forkd ls lists the sandboxes\n")


def test_cli_push_delete_says_what_the_grace_period_left(monkeypatch, capsys):
    from forkd_server.cli import _store, main

    class Stub:
        def delete_remote_snapshot(self, tag):
            return {"digest": "sha256:" + "ab" * 32, "store": "file:///s", "removed_chunks": 0, "kept_chunks": 2,
                    "waiting_chunks": 36}
    monkeypatch.setattr(_store, "client", lambda args: Stub())
    assert main(["push", "--delete", "np"]) == 0
    out = capsys.readouterr().out
    assert "0 chunks removed, 2 kept (other snapshots list them), 36 left for now: no snapshot lists them, but they " \
           "are younger than the store's grace period" in " ".join(out.split())


def test_cli_exec_takes_its_options_after_the_id_and_says_what_to_do(server, ctl):
    ctl.create_snapshot("cli-exec")
    (sb,) = ctl.spawn_sandboxes("cli-exec", 1)
    try:  # before: --timeout-secs ran as the command ("No such file or directory: '--timeout-secs'")
        done = cli(server, "exec", sb["id"], "--timeout-secs", "1", "--", "sleep", "5", check=False)
        assert "timed out after 1 seconds; give it longer with --timeout-secs (it was 1 s)" in done.stderr, done.stderr
        assert json.loads(cli(server, "exec", sb["id"], "--json", "--", "echo", "hi").stdout)["stdout"] == "hi\n"
        done = cli(server, "exec", sb["id"], "--", "no-such-command", check=False)
        assert done.returncode == 1 and done.stderr.startswith("forkd exec: no-such-command: no such command in the "
                                                                "sandbox (FileNotFoundError: "), done.stderr
        assert "run it through a shell: forkd exec ID -- sh -c '...'" in done.stderr
        done = cli(server, "eval", sb["id"], "import os", check=False)  # a statement where an expression goes
        assert done.returncode == 1 and done.stderr == ("SyntaxError: invalid syntax (<eval>, line 1); eval takes one "
                                                         "expression: run statements with forkd run ID CODE\n")
        done = cli(server, "exec", sb["id"], "--bogus", "--", "ls", check=False)
        assert done.returncode == 2 and "unrecognized arguments: --bogus" in one_line(done)
    finally:
        ctl.kill_sandbox(sb["id"])
        ctl.delete_snapshot("cli-exec")


def test_cli_mistakes_in_arguments_and_url_exit_2(server):
    """README: status 2 when no server answers or an argument is wrong, a command's own checks included."""
    for args in (["kill"], ["exec", "sb-x"], ["rmi", "x", "--cascade", "--force"], ["fork"]):
        done = cli(server, *args, check=False)
        assert done.returncode == 2 and one_line(done).startswith(f"forkd {args[0]}: "), (args, done.stderr)
    done = cli(server, "ls", url=server.url.split("://", 1)[1], check=False)  # no scheme
    assert done.returncode == 2 and one_line(done).startswith("forkd ls: not a forkd server's URL: ")
    done = cli(server, "ls", url=server.url + "/v1", check=False)  # forkd's empty 404 for a path it has no route for
    assert one_line(done) == ("forkd ls: /v1/v1/sandboxes is not a route of this server (HTTP 404); point FORKD_URL "
                              "(--url, base_url) at the server's base URL, without /v1: http://HOST:8889 for forkd "
                              "serve, http://HOST:8888/forkd inside Jupyter\n")


def test_cli_push_and_pull_fail_in_one_line_off_a_terminal(server):
    """Their progress bar is drawn only on a terminal: off one it left an empty line before the error."""
    for args in (["push", "nope"], ["pull", "nope"], ["kill", "sb-a", "sb-b"]):
        done = cli(server, *args, check=False)
        assert done.returncode == 1 and not done.stderr.startswith("\n"), (args, done.stderr)
    assert "this server has no remote store" in one_line(cli(server, "push", "nope", check=False))


def test_cli_doctor_json(server):
    rows = json.loads(cli(server, "doctor", "--json", "--data-dir", server.data_dir).stdout)
    checks = {r["check"]: r for r in rows}
    assert {"privileges", "namespaces", "cgroups", "cgroup moves", "seccomp", "kvm", "pvm", "qemu", "userfaultfd", "free disk",
            "reflink", "server"} <= set(checks)
    assert all(r["status"] in ("ok", "warn", "fail", "info") for r in rows)
    assert checks["server"]["status"] == "ok" and server.url in checks["server"]["detail"]
    assert all(r["fix"] for r in rows if r["status"] in ("warn", "fail"))


def test_cli_doctor_checks_the_host_whatever_the_url(server):
    rows = json.loads(cli(server, "doctor", "--json", "--data-dir", server.data_dir, "--url", "localhost:1").stdout)
    checks = {r["check"]: r for r in rows}
    assert {"namespaces", "cgroups", "free disk"} <= set(checks)  # the host's own rows are all there
    assert checks["server"]["status"] == "warn" and checks["server"]["detail"].startswith("not a forkd server's URL")
    rows = json.loads(cli(server, "doctor", "--json", "--data-dir", server.data_dir, "--url", server.url + "/v1").stdout)
    server_row = next(r for r in rows if r["check"] == "server")
    assert "\n" not in server_row["detail"] and "without /v1" in server_row["fix"]


def test_cli_bench_json(server):
    figures = json.loads(cli(server, "bench", "--n", "3", "--json").stdout)
    for key in ("snapshot_ms", "spawn_n1_ms", "exec_ms", "ping_ms", "branch_full_ms", "fanout_ms", "cleanup_ms"):
        assert figures[key] > 0, key
    assert figures["branch_live_pause_ms"] >= 0


# --- serve's own rules --------------------------------------------------------------------------

def test_restart_keeps_sandboxes(workdir, token_file):
    """A server restart re-attaches to the sandboxes (they outlive the server by design), and says in
    its log how long its start took to listen, stage by stage (forkd_server/startup.py)."""
    data = os.path.join(workdir, "restart")
    first = Server("--token-file", token_file, data_dir=data)
    token = open(token_file).read().strip()
    first.wait_healthy()
    ctl = Controller(f"http://127.0.0.1:{first.port}", token)
    ctl.create_snapshot("keep", setup="kept = 'yes'")
    kid = ctl.spawn_sandboxes("keep")[0]
    assert first.stop() == 0  # SIGTERM: a clean shutdown
    second = Server("--token-file", token_file, data_dir=data)
    try:
        second.wait_healthy()
        second.wait_settled()  # it listens first; a sandbox is listed once it is settled (recovery.py)
        ctl = Controller(f"http://127.0.0.1:{second.port}", token)
        assert [s["id"] for s in ctl.list_sandboxes()] == [kid["id"]]
        assert ctl.eval_code(kid["id"], "kept")["result"] == "'yes'"
        ctl.kill_sandbox(kid["id"])
        ctl.delete_snapshot("keep")
        line = re.search(r"forkd: listening ([\d.]+) s after the process started \((.*)\)", second.output())
        assert line, second.output()
        stages = [part.rsplit(" +", 1)[0] for part in line[2].split(", ")]
        assert stages[0] == "python and the CLI" and stages[-1] == "listening", stages
        assert {"registry opened", "recovery planned (registry read)", "web app built"} <= set(stages), stages
        assert sum(float(part.rsplit(" +", 1)[1]) for part in line[2].split(", ")) == pytest.approx(
            float(line[1]), abs=0.01)
    finally:
        second.stop()


def test_generated_token_is_shown_once_and_works(workdir):
    srv = Server(data_dir=os.path.join(workdir, "gen"))
    try:
        srv.wait_healthy()
        deadline = time.monotonic() + 10
        while "FORKD_TOKEN=" not in srv.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        out = srv.output()
        token = out.split("FORKD_TOKEN=", 1)[1].split()[0]
        assert len(token) >= 32 and out.count(token) == 1
        ctl = Controller(f"http://127.0.0.1:{srv.port}", token)
        assert ctl.list_sandboxes() == []
        with pytest.raises(ControllerError) as info:
            Controller(f"http://127.0.0.1:{srv.port}", "").list_sandboxes()
        assert info.value.status == 401
    finally:
        srv.stop()


REFUSED = [
    (["--host", "0.0.0.0"], "refusing to listen on 0.0.0.0"),
    (["--host", "0.0.0.0", "--no-token"], "refusing to listen on 0.0.0.0"),
    (["--tls-cert", "/nope.pem"], "--tls-cert and --tls-key go together"),
]
BAD_TOKENS = [("short", "too short"), ("REPLACE_ME-0123456789abcdef", "placeholder"), ("  \n", "is empty")]


@pytest.fixture(scope="module")
def refused(workdir):
    """What ``forkd serve`` says to each line above, and to a token file holding each bad token
    ({args or content: (exit code, stderr)}), all asked of one process."""
    lines = {tuple(args): args for args, _ in REFUSED}
    for i, (content, _) in enumerate(BAD_TOKENS):
        path = os.path.join(workdir, f"badtoken{i}")
        with open(path, "w") as f:
            f.write(content)
        lines[content] = ["--token-file", path]
    said = refusals([["serve", "--port", str(free_port()), "--data-dir", os.path.join(workdir, "r"), *args]
                     for args in lines.values()])
    return dict(zip(lines, said))


@pytest.mark.parametrize("args,message", REFUSED)
def test_serve_refuses(refused, args, message):
    code, stderr = refused[tuple(args)]
    assert code == 2 and message in stderr, stderr


@pytest.mark.parametrize("content,message", BAD_TOKENS)
def test_serve_refuses_bad_token_files(refused, content, message):
    code, stderr = refused[content]
    assert code == 2 and message in stderr, stderr


def test_non_loopback_bind_with_token(workdir, token_file):
    srv = Server("--host", "0.0.0.0", "--token-file", token_file, data_dir=os.path.join(workdir, "wide"))
    try:
        srv.wait_healthy()
        token = open(token_file).read().strip()
        assert Controller(f"http://127.0.0.1:{srv.port}", token).list_sandboxes() == []
    finally:
        srv.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls(workdir, token_file):
    cert, key = os.path.join(workdir, "cert.pem"), os.path.join(workdir, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    srv = Server("--token-file", token_file, "--tls-cert", cert, "--tls-key", key, data_dir=os.path.join(workdir, "tls"))
    try:
        srv.wait_healthy(scheme="https")
        ctx = ssl.create_default_context(cafile=cert)
        ctx.check_hostname = False
        req = urllib.request.Request(f"https://127.0.0.1:{srv.port}/v1/sandboxes",
                                     headers={"Authorization": f"Bearer {open(token_file).read().strip()}"})
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            assert json.loads(r.read()) == []
        with pytest.raises(OSError):  # plain HTTP is not served
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/healthz", timeout=5)
    finally:
        srv.stop()


def test_no_token_on_loopback(workdir):
    """forkd's default without --token-file: no auth, loopback only; bodies must be JSON (no CSRF by form)."""
    srv = Server("--no-token", data_dir=os.path.join(workdir, "open"))
    try:
        srv.wait_healthy()
        ctl = Controller(f"http://127.0.0.1:{srv.port}", "")
        assert ctl.list_sandboxes() == []
        assert "no token" in srv.output()
        req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/v1/sandboxes", method="POST",
                                     data=b'{"snapshot_tag": "x"}', headers={"Content-Type": "text/plain"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 415
        with pytest.raises(ControllerError) as info:
            ctl.spawn_sandboxes("nope")
        assert (info.value.status, info.value.body) == (404, {"error": "snapshot nope not found"})
    finally:
        srv.stop()
