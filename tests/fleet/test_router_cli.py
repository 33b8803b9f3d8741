"""``forkd router``'s options: what it refuses (exit 2, one line saying why), and TLS both ways (the
router serving https, and https hosts checked against --hosts-ca)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request
import warnings

import pytest

from ..serving import FORKD, Server, free_port, refusals


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="fkrc")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def stop(router: subprocess.Popen) -> None:
    """SIGTERM, as a user stops it; a router still running 30 s later is killed, and what its
    signals were then (blocked, ignored, pending, caught) is said as a warning of the run, so a stop
    that hangs is not lost in the teardown (one did, once: test_router_stop.py)."""
    router.terminate()
    try:
        router.wait(30)
    except subprocess.TimeoutExpired:
        with open(f"/proc/{router.pid}/status") as f:
            signals = " ".join(line.strip() for line in f if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
        router.kill()
        router.wait()
        warnings.warn(f"forkd router (pid {router.pid}) did not stop within 30 s of SIGTERM; killed. {signals}")


def token_file(workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(secrets.token_hex(20))
    return path


def call(url: str, token_path: str, ctx, method: str, path: str, body=None):
    with open(token_path) as f:
        token = f.read()
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=120) as r:
        data = r.read()
    return json.loads(data) if data else None


REFUSED = [
    (["--hosts", ""], "or let them register themselves"),
    (["--hosts", "http://a:1", "--hosts-dns", "http://b:1"], "not both"),
    (["--hosts-dns", "forkd-hosts:8889"], "is not a URL of the hosts' name"),
    (["--hosts", " , "], "--hosts is empty"),
    (["--hosts", "10.0.0.1:8889"], "is not a host's URL"),
    (["--hosts", "http://a:1,http://a:1"], "names a host twice"),
    (["--hosts", "http://a:1"], "pass --token-file FILE"),
    (["--hosts", "http://a:1", "--host", "0.0.0.0", "--no-token"], "refusing to listen on 0.0.0.0"),
    (["--hosts", "http://a:1", "--no-token", "--tls-cert", "/nope.pem"], "--tls-cert and --tls-key go together"),
    (["--hosts", "http://a:1", "--no-token", "--hosts-token-file", "/nope-token"],
     "cannot read --hosts-token-file /nope-token"),  # the flag the user gave, not --token-file
]
HUB_REFUSED = [
    (["--hub", "--no-token"], "--no-token and --hub do not go together"),
    (["--hub"], "--hub needs JUPYTERHUB_API_TOKEN and JUPYTERHUB_SERVICE_NAME in the environment"),
]


@pytest.fixture(scope="module")
def refused():
    """What ``forkd router`` says to each line above ({args: (exit code, stderr)}), all asked of one
    process, in an environment without JupyterHub's variables (as a router JupyterHub did not start)."""
    path = tempfile.mkdtemp(prefix="fkrc")
    lines = [["--hosts", "http://127.0.0.1:1", *args] for args, _ in HUB_REFUSED] + [args for args, _ in REFUSED]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    try:
        said = refusals([["router", "--port", str(free_port()), "--data-dir", path, *args] for args in lines], env)
        yield dict(zip(map(tuple, lines), said))
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("args,message", REFUSED)
def test_router_refuses(refused, args, message):
    code, stderr = refused[tuple(args)]
    assert code == 2 and message in stderr, stderr


@pytest.mark.parametrize("args,message", HUB_REFUSED)
def test_router_refuses_a_hub_mode_it_cannot_run(refused, args, message):
    code, stderr = refused[("--hosts", "http://127.0.0.1:1", *args)]
    assert code == 2 and message in stderr, stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls_to_the_router_and_to_its_hosts(workdir):
    cert, key = os.path.join(workdir, "cert.pem"), os.path.join(workdir, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    hosts_token, router_token = token_file(workdir, "h"), token_file(workdir, "r")
    host = Server("--token-file", hosts_token, "--tls-cert", cert, "--tls-key", key,
                  data_dir=os.path.join(workdir, "host"))
    port = free_port()
    router = None
    try:
        host.wait_healthy(scheme="https")
        router = subprocess.Popen([*FORKD, "router", "--hosts", f"https://127.0.0.1:{host.port}", "--hosts-token-file",
                                   hosts_token, "--hosts-ca", cert, "--token-file", router_token, "--port", str(port),
                                   "--tls-cert", cert, "--tls-key", key, "--data-dir", workdir],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ctx = ssl.create_default_context(cafile=cert)
        lines = []
        while not any("listening on" in x for x in lines) and router.poll() is None:
            lines.append(router.stdout.readline())  # what it prints up to the line saying it listens
        assert "listening on https://" in lines[-1] and "(1 up)" in lines[-1], lines
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=30) as r:
            assert json.loads(r.read())["hosts_up"] == 1
        at_host = f"https://127.0.0.1:{host.port}"
        call(at_host, hosts_token, ctx, "POST", "/v1/snapshots", {"tag": "tls", "setup": "x = 1"})
        kid = call(f"https://127.0.0.1:{port}", router_token, ctx, "POST", "/v1/sandboxes", {"snapshot_tag": "tls"})[0]
        assert kid["host"] == at_host
        got = call(f"https://127.0.0.1:{port}", router_token, ctx, "POST", f"/v1/sandboxes/{kid['id']}/eval",
                   {"code": "x + 1"})
        assert got["result"] == "2"
        call(at_host, hosts_token, ctx, "DELETE", f"/v1/sandboxes/{kid['id']}")
        call(at_host, hosts_token, ctx, "DELETE", "/v1/snapshots/tls")
    finally:
        if router is not None:
            stop(router)
        host.stop()


def test_a_host_the_router_cannot_read_is_named_with_the_fix(workdir):
    """Hosts started with a token, a router without --hosts-token-file: the host never comes up. Its
    start says so and why, and a call that finds nothing names the host it could not ask and the fix,
    rather than a bare 'not found on any host of the fleet'."""
    host = Server("--token-file", token_file(workdir, "h"), data_dir=os.path.join(workdir, "host"))
    router_token = token_file(workdir, "r")
    port = free_port()
    router = None
    try:
        host.wait_healthy()
        router = subprocess.Popen([*FORKD, "router", "--hosts", host.url, "--token-file", router_token, "--port",
                                   str(port), "--data-dir", workdir], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        lines = []
        while not any("clients use it" in x for x in lines) and router.poll() is None:
            lines.append(router.stdout.readline())
        said = "".join(lines)
        assert "(0 up)" in said and f"forkd router: host {host.url} is not up: " in said, said
        assert "answered 401" in said and "pass --hosts-token-file FILE" in said, said
        with pytest.raises(urllib.error.HTTPError) as info:
            call(f"http://127.0.0.1:{port}", router_token, None, "POST", "/v1/sandboxes", {"snapshot_tag": "py"})
        error = json.loads(info.value.read())["error"]
        assert info.value.code == 404
        assert error.startswith("snapshot py not found on any host of the fleet that is up\n")
        assert f"1 of 1 hosts are not up, so were not asked: {host.url}: " in error and "--hosts-token-file" in error
    finally:
        if router is not None:
            stop(router)
        host.stop()


def test_a_port_in_use_is_one_line_and_starts_nothing(workdir):
    """Before: '[Errno 98] Address already in use', then aiohttp's warnings of the heartbeat's unclosed
    sessions (the heartbeat had started before the bind)."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([*FORKD, "router", "--hosts", "http://127.0.0.1:1", "--no-token", "--port", str(port),
                               "--data-dir", workdir], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == (f"forkd router: 127.0.0.1:{port} is already in use by another "
                                                    f"process: pass --port N\n"), done.stderr
