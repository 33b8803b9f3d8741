"""A real ``forkd serve`` in a subprocess, for tests that drive it like a user: SDK, CLI, kernel."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

from forkd_server.client import Controller, ControllerError, ServerUnreachable

FORKD = [sys.executable, "-c", "import sys; from forkd_server.cli import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, data_dir: str, env: dict | None = None):
        self.port = free_port()
        self.data_dir = data_dir
        self.args, self.env = args, env or os.environ.copy()
        self.log = tempfile.NamedTemporaryFile(prefix="fk-serve-", suffix=".log", delete=False)
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen([*FORKD, "serve", "--port", str(self.port), "--data-dir", self.data_dir,
                                      *self.args], stdout=self.log, stderr=subprocess.STDOUT, env=self.env)

    def crash_and_restart(self) -> None:
        """kill -9 the server and start it again on the same port and data dir (sandboxes outlive it)."""
        self.proc.kill()
        self.proc.wait()
        self._start()
        self.wait_healthy()

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
                with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.port}/healthz", timeout=1,
                                            context=ctx) as r:
                    assert json.loads(r.read()) == {"ok": True}
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
