"""A fleet for tests and bench/fleet.py: ``forkd serve`` hosts sharing one host token, each with a
data dir of its own, and a real ``forkd router`` (a subprocess) in front of them."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import secrets
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

from tests.serving import FORKD, Server, cleanup, free_port

HEARTBEAT = 0.3   # s: the test router's heartbeat
DOWN_AFTER = 3.0  # s: and its --down-after
HOST_TIMEOUT = 3.0  # s: and its --host-timeout (a merged list waits that long for a host whose link hangs)


class Router:
    """``forkd router`` for ``hosts`` (URLs, or ``["--hosts-dns", URL]``, or none: hosts that register
    themselves); ``wrap``: a command it runs under (e.g. a mount namespace of its own)."""

    def __init__(self, hosts: list[str], workdir: str, *extra: str, wrap: tuple[str, ...] = ()):
        self.workdir = workdir
        self.port = free_port()
        self.token = secrets.token_hex(20)
        self.token_file = os.path.join(workdir, f"router-token-{self.port}")  # one each: routers may share workdir
        with open(self.token_file, "w") as f:
            f.write(self.token)
        where = hosts if hosts[:1] == ["--hosts-dns"] or not hosts else ["--hosts", ",".join(hosts)]
        self.wrap = list(wrap)
        self.args = ["router", *where, "--hosts-token-file", os.path.join(workdir, "token"),
                     "--token-file", self.token_file, "--port", str(self.port),
                     "--data-dir", os.path.join(workdir, "router"), "--heartbeat", str(HEARTBEAT),
                     "--down-after", str(DOWN_AFTER), "--host-timeout", str(HOST_TIMEOUT), *extra]
        self.log_path = os.path.join(workdir, f"router-{self.port}.log")
        self.start()

    url = property(lambda self: f"http://127.0.0.1:{self.port}")
    db = property(lambda self: os.path.join(self.workdir, "router", "router", "router.db"))  # its state file

    def start(self) -> None:
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen([*self.wrap, *FORKD, *self.args], stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda h: h["ok"], "answer /healthz")

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=10) as r:
            return json.loads(r.read())

    def hosts(self) -> dict[str, dict]:
        req = urllib.request.Request(f"{self.url}/v1/fleet/hosts", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return {h["url"]: h for h in json.loads(r.read())}

    def wait(self, condition, what: str, timeout: float = 60) -> dict:
        """Bounded polling of /healthz until ``condition(health)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"forkd router exited {self.proc.returncode}:\n{self.output()}")
            try:
                health = self.health()
                if condition(health):
                    return health
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"forkd router did not {what} within {timeout} s:\n{self.output()}")
            time.sleep(0.05)

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def stop_hosts(hosts, token: str) -> None:
    """Delete what each running host holds and stop it; a host that ended leaves only its log."""
    for srv in hosts:
        if srv.proc.poll() is None:
            cleanup(srv.url, token)
            srv.stop()
        else:
            os.unlink(srv.log.name)
        if hasattr(srv, "remove"):
            srv.remove()


def count_alike(hosts, value: int = 0) -> None:
    """Make every host number its next sandbox ``value``, as hosts that all began at the same number
    would (a new data dir's numbering begins at random): what makes them hand out the same ids. Set
    in each running host's registry, which reads its counter afresh for every spawn."""
    for srv in hosts:
        db = sqlite3.connect(os.path.join(srv.data_dir, "registry.sqlite3"), timeout=30)
        with db:
            db.execute("INSERT OR REPLACE INTO counters(name, value) VALUES ('sandbox', ?)", (value,))
        db.close()


@contextlib.contextmanager
def stand_in_host(handler: type[http.server.BaseHTTPRequestHandler], release: threading.Event | None = None):
    """A stand-in for a host: ``handler`` served on a free loopback port, on a thread; yields its
    URL. On exit ``release`` is set first (whatever the handler holds back goes), then it stops."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if release is not None:
            release.set()
        server.shutdown()
        server.server_close()


def forwarding(target: str, before=None, rewrite=None) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler for ``stand_in_host`` that passes each request on to the host at ``target`` and its
    answer back as it streams (its event stream too); ``before(method, path)`` runs first: what a
    test makes happen between the router's last look at the host and the host's answer (or holds
    the request there); ``rewrite(method, path, body)``: the answer's body as the router is to read
    it (every answer but the event stream's)."""
    where = urllib.parse.urlsplit(target)
    hop = {"host", "connection", "keep-alive", "transfer-encoding", "date", "server"}

    class Forward(http.server.BaseHTTPRequestHandler):
        def _pass_on(self) -> None:
            if before is not None:
                before(self.command, self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
            try:
                conn.request(self.command, self.path, body,
                             {k: v for k, v in self.headers.items() if k.lower() not in hop})
                answer = conn.getresponse()
                whole = None
                if rewrite is not None and not self.path.startswith("/v1/events"):
                    whole = rewrite(self.command, self.path, answer.read())
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in hop and not (whole is not None and key.lower() == "content-length"):
                        self.send_header(key, value)
                if whole is not None:
                    self.send_header("Content-Length", str(len(whole)))
                self.send_header("Connection", "close")
                self.end_headers()
                if whole is not None:
                    self.wfile.write(whole)
                    return
                while chunk := answer.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except OSError:
                pass  # the router or the host went away: so does this request
            finally:
                conn.close()

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _pass_on

        def log_message(self, *args) -> None:
            pass

    return Forward


@contextlib.contextmanager
def fleet(n_hosts: int = 2, host_args: list[list[str]] | None = None, extra_hosts: tuple[str, ...] = (),
          router_args: tuple[str, ...] = (), server=Server, router: bool = True,
          host_env: list[dict[str, str]] | None = None):
    """``n_hosts`` hosts and a router, all up; yields (router, [hosts]). ``extra_hosts``: more URLs
    the router is given (hosts that misbehave); ``server``: the host class (``netns.NamespacedServer``
    puts each host in a network namespace of its own); ``router=False``: no router, and (workdir,
    [hosts]) is yielded; ``host_env``: each host's variables over this process's environment. On
    exit every host's objects are deleted and everything stops."""
    workdir = tempfile.mkdtemp(prefix="fkfl")
    token = secrets.token_hex(20)
    with open(os.path.join(workdir, "token"), "w") as f:
        f.write(token)
    hosts: list[Server] = []
    with_router, router = router, None
    try:
        for i in range(n_hosts):
            args = (host_args or [[]] * n_hosts)[i]
            runtime = os.path.join(workdir, f"rt{i}")
            env = {**os.environ, **(host_env or [{}] * n_hosts)[i], "JUPYTER_RUNTIME_DIR": runtime}
            srv = server("--token-file", os.path.join(workdir, "token"), *args, data_dir=os.path.join(workdir, f"h{i}"),
                         env=env)
            srv.token = token
            hosts.append(srv)
        for srv in hosts:
            srv.wait_healthy()
        if not with_router:
            yield workdir, hosts
            return
        router = Router([h.url for h in hosts] + list(extra_hosts), workdir, *router_args)
        router.wait(lambda h: h["hosts_up"] >= n_hosts, "see every host up")
        yield router, hosts
    finally:
        if router is not None:
            router.stop()
        stop_hosts(hosts, token)
        shutil.rmtree(workdir, ignore_errors=True)


def wait_for(condition, what: str, timeout: float = 60):
    """``condition()``'s first true value, polled every 50 ms; AssertionError naming ``what`` past
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return got
