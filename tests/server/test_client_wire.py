"""The client SDK sends exactly what forkd's PyPI SDK sends (reference/forkd-api.md §8).

A recording HTTP server stands in for the daemon: these tests are about bytes on the wire.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from forkd_server.client import Controller, ControllerError, ServerUnreachable


class Recorder(BaseHTTPRequestHandler):
    seen: list[dict] = []
    reply: tuple[int, bytes] = (200, b"{}")

    def _record(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body})
        status, payload = self.reply
        self.send_response(status)
        if payload:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_DELETE = do_PUT = _record

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    Recorder.seen = []
    Recorder.reply = (200, b"{}")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def ctl(recorder, monkeypatch):
    monkeypatch.delenv("FORKD_TOKEN", raising=False)
    return Controller(f"http://127.0.0.1:{recorder.server_port}/", token="t0k3n")


def last():
    return Recorder.seen[-1]


CASES = [
    (lambda c: c.list_snapshots(), "GET", "/v1/snapshots", None),
    (lambda c: c.delete_snapshot("py"), "DELETE", "/v1/snapshots/py", None),
    (lambda c: c.spawn_sandboxes("py"), "POST", "/v1/sandboxes",
     b'{"snapshot_tag": "py", "n": 1, "per_child_netns": false}'),
    (lambda c: c.spawn_sandboxes("py", n=3, per_child_netns=True, memory_limit_mib=256, prewarm=True, live_fork=True,
                                 hugepages=True), "POST", "/v1/sandboxes",
     b'{"snapshot_tag": "py", "n": 3, "per_child_netns": true, "memory_limit_mib": 256, "prewarm": true, '
     b'"live_fork": true, "hugepages": true}'),
    (lambda c: c.list_sandboxes(), "GET", "/v1/sandboxes", None),
    (lambda c: c.get_sandbox("sb-1"), "GET", "/v1/sandboxes/sb-1", None),
    (lambda c: c.kill_sandbox("sb-1"), "DELETE", "/v1/sandboxes/sb-1", None),
    (lambda c: c.kill_sandbox("sb-1", reason="it lost"), "DELETE", "/v1/sandboxes/sb-1?reason=it+lost", None),
    (lambda c: c.branch_sandbox("sb-1"), "POST", "/v1/sandboxes/sb-1/branch", b"{}"),
    (lambda c: c.branch_sandbox("sb-1", tag="t1", diff=True, measure_diff=True), "POST", "/v1/sandboxes/sb-1/branch",
     b'{"tag": "t1", "diff": true, "measure_diff": true}'),
    (lambda c: c.branch_sandbox("sb-1", tag="t2", mode="live", wait=False), "POST", "/v1/sandboxes/sb-1/branch",
     b'{"tag": "t2", "mode": "live", "wait": false}'),
    (lambda c: c.exec_command("sb-1", ["python3", "-c", "print(2+2)"]), "POST", "/v1/sandboxes/sb-1/exec",
     b'{"args": ["python3", "-c", "print(2+2)"], "timeout_secs": 30}'),
    (lambda c: c.eval_code("sb-1", "1+1"), "POST", "/v1/sandboxes/sb-1/eval", b'{"code": "1+1"}'),
]


@pytest.mark.parametrize("fn,method,path,body", CASES, ids=[f"{m} {p} {i}" for i, (_, m, p, _b) in enumerate(CASES)])
def test_forkd_sdk_wire(ctl, fn, method, path, body):
    fn(ctl)
    req = last()
    assert (req["method"], req["path"]) == (method, path)
    assert req["headers"]["Authorization"] == "Bearer t0k3n"
    assert req["headers"]["User-Agent"].startswith("Python-urllib/3.")
    if body is None:
        assert req["body"] == b"" and "Content-Type" not in req["headers"]
    else:
        assert req["body"] == body
        assert req["headers"]["Content-Type"] == "application/json"


def test_ping_has_no_body_and_no_content_type(ctl):
    ctl.ping_sandbox("sb-1")
    req = last()
    assert (req["method"], req["path"], req["body"]) == ("POST", "/v1/sandboxes/sb-1/ping", b"")
    assert req["headers"]["Content-Length"] == "0" and "Content-Type" not in req["headers"]


def test_base_url_prefix_and_env(recorder, monkeypatch):
    monkeypatch.setenv("FORKD_URL", f"http://127.0.0.1:{recorder.server_port}/a/forkd/")
    monkeypatch.setenv("FORKD_TOKEN", "from-env")
    Controller().list_sandboxes()
    assert last()["path"] == "/a/forkd/v1/sandboxes"
    assert last()["headers"]["Authorization"] == "Bearer from-env"


def test_no_token_sends_no_authorization(recorder, monkeypatch):
    monkeypatch.delenv("FORKD_TOKEN", raising=False)
    Controller(f"http://127.0.0.1:{recorder.server_port}").list_sandboxes()
    assert "Authorization" not in last()["headers"]


def test_errors(ctl):
    Recorder.reply = (404, b'{"error": "sandbox sb-x not found"}')
    with pytest.raises(ControllerError) as info:
        ctl.get_sandbox("sb-x")
    assert info.value.status == 404 and info.value.body == {"error": "sandbox sb-x not found"}
    assert info.value.message == "sandbox sb-x not found" and info.value.url.endswith("/v1/sandboxes/sb-x")
    Recorder.reply = (204, b"")
    assert ctl.kill_sandbox("sb-1") is None


WORKSPACE_CASES = [
    (lambda c: c.compact_snapshot("py", "py2"), "POST", "/v1/snapshots/py/compact", b'{"to": "py2"}'),
    (lambda c: c.share_snapshot("py"), "POST", "/v1/snapshots/py/share", None),
    (lambda c: c.unshare_snapshot("py"), "DELETE", "/v1/snapshots/py/share", None),
    (lambda c: c.list_workspaces(), "GET", "/v1/workspaces", None),
    (lambda c: c.create_workspace("w1", "py"), "POST", "/v1/workspaces", b'{"name": "w1", "snapshot_tag": "py"}'),
    (lambda c: c.create_workspace("w1", "py", memory_limit_mib=256), "POST", "/v1/workspaces",
     b'{"name": "w1", "snapshot_tag": "py", "memory_limit_mib": 256}'),
    (lambda c: c.get_workspace("w1"), "GET", "/v1/workspaces/w1", None),
    (lambda c: c.suspend_workspace("w1"), "POST", "/v1/workspaces/w1/suspend", b'{"diff": false}'),
    (lambda c: c.suspend_workspace("w1", diff=True), "POST", "/v1/workspaces/w1/suspend", b'{"diff": true}'),
    (lambda c: c.resume_workspace("w1"), "POST", "/v1/workspaces/w1/resume", None),
    (lambda c: c.delete_workspace("w1"), "DELETE", "/v1/workspaces/w1", None),
]


def test_compact_and_workspace_wire(ctl):
    """One test for all (each recorder fixture costs half a second to stop)."""
    for fn, method, path, body in WORKSPACE_CASES:
        fn(ctl)
        req = last()
        assert (req["method"], req["path"], req["body"]) == (method, path, body or b""), path
        assert req["headers"]["Authorization"] == "Bearer t0k3n"
        assert ("Content-Type" in req["headers"]) == (body is not None), path


def test_extras_wire(ctl):
    ctl.delete_snapshot("py", cascade=True)
    assert last()["path"] == "/v1/snapshots/py?cascade=true"
    ctl.create_snapshot("py", setup="x = 1", setup_commands=[["true"]])
    assert json.loads(last()["body"]) == {"tag": "py", "engine": "auto", "setup": "x = 1", "setup_commands": [["true"]]}
    Recorder.reply = (200, b'{"path": "/tmp/a b", "size": 3}')
    ctl.write_file("sb-1", "/tmp/a b", b"abc")
    req = last()
    assert (req["method"], req["path"], req["body"]) == ("PUT", "/v1/sandboxes/sb-1/files?path=%2Ftmp%2Fa+b", b"abc")
    assert req["headers"]["Content-Type"] == "application/octet-stream"


def test_unreachable_is_a_urlerror_with_a_hint():
    ctl = Controller("http://127.0.0.1:9", token=None)  # the discard port: nothing listens
    with pytest.raises(ServerUnreachable) as info:
        ctl.list_sandboxes()
    assert isinstance(info.value, urllib.error.URLError)
    assert "no forkd server answers at http://127.0.0.1:9" in str(info.value) and "forkd serve" in str(info.value)


def test_importing_the_client_does_not_import_jupyter_server():
    code = ("import sys, forkd_server.client; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jupyter_server', 'tornado', 'traitlets')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


RECOVERING = json.dumps({"error": "sandbox sb-1 is recovering: the server restarted and has not settled it yet",
                         "recovering": True}).encode()


@pytest.mark.parametrize("first, asked", [((503, RECOVERING), 3), ((503, b'{"error": "too many long calls"}'), 1)])
def test_a_503_recovering_is_asked_again_until_the_object_is_settled(first, asked):
    """A restarted server answers 503 "recovering" (with ``recovering: true``, before doing anything)
    about an object it has not settled yet: the SDK asks again. Any other 503 (a cap) is the answer."""
    replies = [first, first, (200, b'{"id": "sb-1"}')]

    class Settling(Recorder):
        def _record(self):
            Recorder.reply = replies.pop(0)
            super()._record()

        do_GET = _record

    Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Settling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ctl = Controller(f"http://127.0.0.1:{server.server_port}/", token="t0k3n", timeout=10)
        if asked == 1:
            with pytest.raises(ControllerError) as refused:
                ctl.get_sandbox("sb-1")
            assert refused.value.status == 503
        else:
            assert ctl.get_sandbox("sb-1") == {"id": "sb-1"}
        assert len(Recorder.seen) == asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("url", ["127.0.0.1:8889", "localhost:8889", "ftp://127.0.0.1:8889", "http://", "http://h:port"])
def test_a_url_without_scheme_or_host_is_refused_saying_how_to_write_one(url, monkeypatch):
    monkeypatch.delenv("FORKD_TOKEN", raising=False)
    with pytest.raises(ValueError) as info:
        Controller(url)
    assert repr(url) in str(info.value) and "http://127.0.0.1:8889" in str(info.value)


def test_a_jupyter_page_names_the_path_and_how_to_set_the_url_not_the_page(ctl):
    page = b'<!DOCTYPE HTML>\n<html><body data-jupyter-api-token="secret-token">404 : Not Found</body></html>'
    Recorder.reply = (404, page)  # Jupyter's answer to FORKD_URL=http://host:8888 (without /forkd)
    with pytest.raises(ControllerError) as info:
        ctl.list_sandboxes()
    assert info.value.what == "/v1/sandboxes is not a route of this server"
    assert "/forkd inside Jupyter" in info.value.hint
    assert "secret-token" not in str(info.value) and "<html>" not in str(info.value)
    Recorder.reply = (403, page)
    with pytest.raises(ControllerError) as info:
        ctl.list_sandboxes()
    assert info.value.what == "the server answered /v1/sandboxes with a web page (403), not forkd's JSON"


def test_an_empty_404_names_the_path_and_how_to_set_the_url(ctl):
    Recorder.reply = (404, b"")  # what forkd answers for a path it has no route for, e.g. FORKD_URL ending in /v1
    with pytest.raises(ControllerError) as info:
        ctl.list_sandboxes()
    assert info.value.what == "/v1/sandboxes is not a route of this server"
    assert "without /v1" in info.value.hint and info.value.body == {}


@pytest.fixture(scope="module")
def tls_recorder(tmp_path_factory):
    """The recorder over TLS, with a self-signed certificate (the file is its own CA)."""
    import shutil
    import ssl
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    where = tmp_path_factory.mktemp("tls")
    cert, key = str(where / "cert.pem"), str(where / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, cert
    server.shutdown()
    server.server_close()


def test_a_certificate_not_trusted_here_says_so_and_how_to_trust_it(tls_recorder, monkeypatch):
    server, cert = tls_recorder
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    url = f"https://127.0.0.1:{server.server_port}"
    with pytest.raises(ServerUnreachable) as info:
        Controller(url, "t").list_sandboxes()
    assert info.value.what.startswith(f"the server at {url} has a certificate this host does not trust (")
    assert info.value.hint.startswith("set SSL_CERT_FILE to the CA certificate that signed the server's")
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # what the hint says: then it answers
    Recorder.reply = (200, b"[]")
    assert Controller(url, "t").list_sandboxes() == []


def test_http_to_a_tls_server_suggests_https(tls_recorder):
    server, _ = tls_recorder
    with pytest.raises(ServerUnreachable) as info:
        Controller(f"http://127.0.0.1:{server.server_port}", "t", timeout=10).list_sandboxes()
    assert info.value.hint.endswith(f"use https://127.0.0.1:{server.server_port}"), info.value.hint


def test_https_to_a_plain_http_server_gives_up_at_the_connect_timeout_and_suggests_http(monkeypatch):
    """A plain-http server waits for a request line that a TLS ClientHello never completes: the
    handshake has no answer, so the connection gives up after CONNECT_TIMEOUT, not the call's timeout."""
    import socket
    from forkd_server.client import _sync
    monkeypatch.setattr(_sync, "CONNECT_TIMEOUT", 0.5)
    with socket.socket() as listener:  # accepts (the kernel does), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        with pytest.raises(ServerUnreachable) as info:
            Controller(f"https://127.0.0.1:{port}", "t", timeout=5).list_sandboxes()
    assert type(info.value) is ServerUnreachable  # not ServerTimeout: nothing was ever sent
    assert info.value.hint == f"the server may speak plain http: try http://127.0.0.1:{port}"


def test_the_async_client_gives_up_at_the_connect_timeout_too(monkeypatch):
    import asyncio
    import socket
    from forkd_server.client import AsyncController, _http1
    monkeypatch.setattr(_http1, "CONNECT_TIMEOUT", 0.5)

    async def ask(port):
        async with AsyncController(f"https://127.0.0.1:{port}", "t", timeout=5) as ctl:
            await ctl.list_sandboxes()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        with pytest.raises(ServerUnreachable) as info:
            asyncio.run(ask(port))
    assert "within 0.5 s (the TLS handshake had no answer)" in info.value.what
    assert info.value.hint == f"the server may speak plain http: try http://127.0.0.1:{port}"
