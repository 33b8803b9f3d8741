"""A real ``forkd serve`` for the notebook front end's tests (magics, widget, notebooks, browser).

One server per test session (started as a subprocess, like a user would, with a token); every test
that uses ``forkd`` gets it empty and leaves it empty.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from forkd_magics._scope import Scope
from forkd_server.client import Controller, ControllerError, ServerUnreachable

from ..serving import free_port


@dataclass
class ForkdServer:
    url: str
    token: str
    data_dir: str
    log_path: str

    def controller(self) -> Controller:
        return Controller(self.url, self.token)

    @property
    def env(self) -> dict:
        return {**os.environ, "FORKD_URL": self.url, "FORKD_TOKEN": self.token}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def clean(self) -> None:
        """Kill every sandbox and delete every snapshot (deepest first)."""
        ctl = self.controller()
        for sb in ctl.list_sandboxes():
            try:
                ctl.kill_sandbox(sb["id"])
            except ControllerError:
                pass
        for snap in sorted(ctl.list_snapshots(), key=lambda s: -len(s.get("lineage", []))):
            try:
                ctl.delete_snapshot(snap["tag"], cascade=True)
            except ControllerError as exc:
                if exc.status != 404:  # gone with its parent (cascade) is fine
                    raise

@pytest.fixture(scope="session")
def forkd_server():
    if os.geteuid() != 0:
        pytest.skip("the process engine needs root")
    root = tempfile.mkdtemp(prefix="fk")  # short: Unix socket paths are limited to 107 bytes
    token = secrets.token_hex(16)
    token_file = os.path.join(root, "token")
    with open(token_file, "w") as f:
        f.write(token)
    port = free_port()
    log_path = os.path.join(root, "serve.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from forkd_server.cli import main; sys.exit(main())",
         "serve", "--port", str(port), "--data-dir", os.path.join(root, "d"), "--token-file", token_file],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = ForkdServer(f"http://127.0.0.1:{port}", token, os.path.join(root, "d"), log_path)
    try:
        try:
            server.controller().wait_ready(60)  # bounded polling of /healthz
        except ServerUnreachable:
            pytest.fail(f"forkd serve did not start:\n{server.log()}")
        yield server
    finally:
        try:
            server.clean()
        except (ServerUnreachable, ControllerError):
            pass
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        shutil.rmtree(root, ignore_errors=True)

@pytest.fixture
def forkd(forkd_server):
    """The session's server, empty at the start and cleaned at the end of the test."""
    forkd_server.clean()
    yield forkd_server
    forkd_server.clean()

@pytest.fixture(scope="session")
def shell():
    """One IPython shell (IPython keeps one per process), with the magics loaded."""
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "forkd_magics")
    yield ip
    ip.run_line_magic("unload_ext", "forkd_magics")


@pytest.fixture
def ip(shell, forkd, monkeypatch):
    """The shell with fresh magics pointed at the test's server, outside any notebook."""
    monkeypatch.setenv("FORKD_URL", forkd.url)
    monkeypatch.setenv("FORKD_TOKEN", forkd.token)
    shell.run_line_magic("reload_ext", "forkd_magics")  # a fresh ForkdMagics reads the env
    for name in [n for n in shell.user_ns if not n.startswith("_") and n not in shell.user_ns_hidden]:
        del shell.user_ns[name]
    return shell


def magics(ip):
    return ip.magics_manager.registry["ForkdMagics"]


def in_notebook(ip, kernel_id: str, notebook: str | None = None) -> None:
    """From now on the magics act as a notebook's kernel would (its id and path: see
    test_scope.py for the same labels taken from a real kernel)."""
    magics(ip)._scope = Scope(kernel_id, notebook)


def cell(ip, source: str):
    """Run a cell like the notebook does; returns (result, captured output)."""
    with capture_output() as out:
        result = ip.run_cell(source, store_history=False)
    return result, out


__all__ = ["ForkdServer", "free_port", "cell", "magics", "in_notebook"]
