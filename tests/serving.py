"""A real ``forkd serve`` in a subprocess, for tests that drive it like a user: SDK, CLI, kernel."""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from forkd_server.client import Controller, ControllerError, ServerUnreachable

FORKD = [sys.executable, "-c", "import sys; from forkd_server.cli import main; sys.exit(main())"]


# One process answering many refused command lines: each refusal is checked as the CLI makes it
# (exit code, stderr), with one interpreter start-up for them all rather than one each.
_REFUSE = """
import contextlib, io, json, sys
from forkd_server.cli import main
said = []
for argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    said.append([code, err.getvalue()])
sys.__stdout__.write(json.dumps(said))
"""


def refusals(argvs: list[list[str]], env: dict | None = None, timeout: float = 120) -> list[tuple[int, str]]:
    """(exit code, stderr) of ``forkd ARGV`` for each of ``argvs``, all in one real process. A line
    that is not refused goes on to serve and runs into ``timeout``, which fails the caller."""
    done = subprocess.run([sys.executable, "-c", _REFUSE], input=json.dumps(argvs), capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return [tuple(x) for x in json.loads(done.stdout)]


# Ports for the servers tests start: below the kernel's ephemeral range (32768 and up), which
# port 0 binds draw from (Jupyter kernels' ZeroMQ ports, every client socket), so a port handed out
# here cannot be taken by one of those between the check and the server's own bind; each xdist
# worker takes its own residue class, and a port is handed out once per process.
PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    mine = [p for p in PORTS if p % workers == worker % workers and p not in _handed_out]
    for port in random.sample(mine, len(mine)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port left in {PORTS.start}-{PORTS.stop - 1} for this worker")


class Server:
    def __init__(self, *args: str, data_dir: str, env: dict | None = None):
        self.port = free_port()
        self.data_dir = data_dir
        self.args, self.env = args, env or os.environ.copy()
        self.log = tempfile.NamedTemporaryFile(prefix="fk-serve-", suffix=".log", delete=False)
        self._start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self) -> None:
        self.proc = subprocess.Popen([*FORKD, "serve", "--port", str(self.port), "--data-dir", self.data_dir,
                                      *self.args], stdout=self.log, stderr=subprocess.STDOUT, env=self.env)

    def crash(self) -> None:
        """kill -9 the server (sandboxes outlive it); ``start`` starts it again."""
        self.proc.kill()
        self.proc.wait()

    def start(self) -> None:
        """Start the server again on the same port and data dir (without waiting for it)."""
        self._start()

    def crash_and_restart(self) -> None:
        """kill -9 the server and start it again on the same port and data dir (sandboxes outlive it);
        returns once it has settled what it recorded."""
        self.crash()
        self._start()
        self.wait_healthy()
        self.wait_settled()

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=10) as r:
            return json.loads(r.read())

    def wait_settled(self, timeout: float = 120) -> None:
        """Bounded polling until a restarted server has settled what it recorded (/healthz stops
        saying ``recovering``)."""
        deadline = time.monotonic() + timeout
        while "recovering" in self.health():
            if time.monotonic() > deadline:
                raise AssertionError(f"forkd serve did not settle what it recorded:\n{self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def wait_healthy(self, scheme: str = "http", timeout: float = 30) -> None:
        """Bounded polling of /healthz (no sleep standing in for readiness)."""
        ctx = ssl._create_unverified_context() if scheme == "https" else None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"forkd serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{scheme}://{self.url.split('://', 1)[1]}/healthz", timeout=1,
                                            context=ctx) as r:
                    assert json.loads(r.read())["ok"] is True
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"forkd serve did not answer /healthz:\n{self.output()}") from None
                time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)
        return self.proc.returncode


def cleanup(url: str, token: str | None) -> None:
    """Delete everything a server holds (workspaces first: a workspace's state refuses a plain delete)."""
    ctl = Controller(url, token)
    try:
        for ws in ctl.list_workspaces():
            ctl.delete_workspace(ws["name"])
        for sb in ctl.list_sandboxes():
            ctl.kill_sandbox(sb["id"])
        for snap in ctl.list_snapshots():
            try:
                ctl.delete_snapshot(snap["tag"], cascade=True)
            except ControllerError:
                pass
    except ServerUnreachable:
        pass


@contextlib.contextmanager
def serving(*args: str, env: dict | None = None):
    """A healthy ``forkd serve`` with a token and a directory of its own (``workdir``: its data dir
    ``d``, its token file, its Jupyter runtime dir ``rt``, so no other test's discovery finds it).
    On exit everything it holds is deleted, it stops, and the directory goes."""
    workdir = tempfile.mkdtemp(prefix="fk")
    token = secrets.token_hex(20)
    token_file = os.path.join(workdir, "token")
    with open(token_file, "w") as f:
        f.write(token)
    runtime = os.path.join(workdir, "rt")
    srv = Server("--token-file", token_file, *args, data_dir=os.path.join(workdir, "d"),
                 env={**(env if env is not None else os.environ), "JUPYTER_RUNTIME_DIR": runtime})
    srv.workdir, srv.token, srv.runtime_dir = workdir, token, runtime
    try:
        srv.wait_healthy()
        yield srv
    finally:
        cleanup(srv.url, token)
        srv.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class JupyterServer:
    """``jupyter server`` with forkd (as ``jupyter lab`` serves it: routes under ``/forkd/``), a token, a
    root and data dir of its own, no FORKD_URL (its kernels find it through its runtime dir).
    ``stop()`` deletes what it holds, stops it and removes its directory. ``env``: more of its
    environment (``FORKD_URL`` and ``FORKD_TOKEN`` put it in remote mode; ``stop()`` then leaves the
    remote's objects to whoever runs it). ``args``: more of its options (``--ForkdApp.router_hosts=...``
    puts it in router mode; ``stop()`` then leaves the hosts' objects to whoever runs them too)."""

    def __init__(self, env: dict | None = None, port: int | None = None, args: tuple[str, ...] = (),
                 base_url: str = "/"):
        self.base_url = "/" + base_url.strip("/") + "/" if base_url.strip("/") else "/"
        self.workdir = tempfile.mkdtemp(prefix="fkmcp")
        self.token = secrets.token_hex(20)
        self.port = port or free_port()
        self.remote = bool((env or {}).get("FORKD_URL")) or any(a.startswith("--ForkdApp.router_") for a in args)
        env = {**{k: v for k, v in os.environ.items() if k not in ("FORKD_URL", "FORKD_TOKEN")}, **(env or {})}
        env["JUPYTER_RUNTIME_DIR"] = os.path.join(self.workdir, "rt")  # its kernels find it there
        self.log = open(os.path.join(self.workdir, "server.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", f"--port={self.port}",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.workdir}",
             f"--ForkdApp.data_dir={os.path.join(self.workdir, 'd')}", f"--ServerApp.base_url={self.base_url}", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:  # bounded polling of the real condition: forkd's /healthz answers
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter server exited:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.forkd_url}/healthz", timeout=1):
                    break
            except urllib.error.HTTPError:
                if self.remote:  # up: its remote's answer (a 502 for one that does not answer) is the test's
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"jupyter server did not start:\n{self.output()}") from None
                time.sleep(0.05)
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"jupyter server did not start:\n{self.output()}") from None
                time.sleep(0.05)

    url = property(lambda self: f"http://127.0.0.1:{self.port}{self.base_url.rstrip('/')}")
    forkd_url = property(lambda self: f"{self.url}/forkd")
    mcp_url = property(lambda self: f"{self.url}/forkd/mcp")

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def api(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, method=method, data=data, headers={
            "Authorization": f"token {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read()
        return json.loads(text) if text else None

    def stop(self) -> None:
        if not self.remote:
            cleanup(self.forkd_url, self.token)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def burst(url: str, token: str, stop: threading.Event, progress: threading.Semaphore, *,
          prefix: str = "rb", timeout: float = 120) -> None:
    """One thread of a crash burst on snapshot ``base``: spawn 1-5, branch one (live without
    waiting, or full), kill them, delete an older branch; until ``stop``. ``progress`` is released
    after each spawn and each branch. Errors are expected once the server is killed under it."""
    client = Controller(url, token, timeout=timeout)
    rng = random.Random(threading.get_ident())
    mine: list[str] = []
    n = 0
    while not stop.is_set():
        n += 1
        try:
            kids = client.spawn_sandboxes("base", rng.randint(1, 5))
            progress.release()
            tag = f"{prefix}-{secrets.token_hex(4)}"
            live = n % 2 == 1
            client.branch_sandbox(kids[0]["id"], tag, mode="live" if live else "full", wait=not live)
            mine.append(tag)
            progress.release()
            for kid in kids:
                client.kill_sandbox(kid["id"])
            if len(mine) > 1:
                client.delete_snapshot(mine.pop(0))
        except (ControllerError, ServerUnreachable):
            if stop.is_set():
                return


def status_of(url: str, method: str) -> int:
    """The status of one request with an empty JSON body where the method takes one; a streaming
    reply (/v1/events) is read only as far as its first byte."""
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            reply.read(1)  # enough: /v1/events streams until the client goes
            return reply.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code
