"""A real JupyterHub (DummyAuthenticator, SimpleLocalProcessSpawner, configurable-http-proxy from
tests/hub/node_modules) with ``forkd serve`` as a Hub-managed service at /services/forkd/, on free
ports and in a directory of its own; stopped with everything it started."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from tests.rest import exchange
from tests.serving import cleanup, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
PROXY = os.path.join(HERE, "node_modules", ".bin", "configurable-http-proxy")
needs_proxy = pytest.mark.skipif(not os.path.exists(PROXY), reason="configurable-http-proxy is not installed in "
                                                                   "tests/hub (scripts/setup.sh test installs it)")
ROOT = os.path.dirname(os.path.dirname(HERE))

CONFIG = """
import sys
c = get_config()  # noqa
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {public_port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.JupyterHub.db_url = "sqlite:///{workdir}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{workdir}/cookie_secret"
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = "{workdir}/home/{{username}}"
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
# the singleuser server of a test needs no JupyterLab; its forkd extension passes on to FORKD_URL (remote mode)
c.Spawner.args = ["--allow-root", "--ServerApp.jpserver_extensions={{'jupyterlab': False}}"]
c.Spawner.default_url = "/api"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120

{forkd_lines}

# the test's own client: makes users and their tokens, starts and stops their servers
c.JupyterHub.services.append({{"name": "tester", "api_token": "{tester_token}"}})
c.JupyterHub.load_roles.append({{"name": "tester", "services": ["tester"],
    "scopes": ["admin:users", "admin:servers", "tokens", "access:services!service=forkd", "read:users"]}})
"""

DOC = os.path.join(ROOT, "docs", "deploy", "jupyterhub.md")


SERVE_SECTION = "## forkd as a JupyterHub service"
ROUTER_SECTION = "## The fleet's router as a JupyterHub service"


def documented_config(heading: str = SERVE_SECTION) -> str:
    """The ``jupyterhub_config.py`` lines docs/deploy/jupyterhub.md gives under ``heading``: for
    forkd serve as a service, or for the fleet's router."""
    with open(DOC) as f:
        text = f.read()
    section = text[text.index(heading):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n")]


# The documented lines as they are, then only what a test must change: the addresses, the command
# (this checkout's forkd, its own data dir and operator token), the environment it runs in.
FORKD_LINES = """
{documented}
c.JupyterHub.services[0].update({{"url": "http://127.0.0.1:{forkd_port}", "command": {command!r},
                                  "environment": {environment!r}}})
c.Spawner.environment["FORKD_URL"] = "http://127.0.0.1:{public_port}/services/forkd"
c.JupyterHub.load_roles = []
"""


class Hub:
    """``forkd_args``: the forkd command the Hub runs as its service (default: ``forkd serve`` on a
    data dir of its own); ``heading``: the docs' section whose lines configure it."""

    def __init__(self, forkd_args: list[str] | None = None, heading: str = SERVE_SECTION):
        self.workdir = tempfile.mkdtemp(prefix="fkhub")
        self.ports = {name: free_port() for name in ("public_port", "hub_port", "proxy_api_port", "forkd_port")}
        self.tester_token = secrets.token_hex(24)
        self.tokens: dict[str, str] = {}
        self.operator_token = secrets.token_hex(24)
        self.data_dir = os.path.join(self.workdir, "d")
        token_file = os.path.join(self.workdir, "operator-token")
        with open(token_file, "w") as f:
            f.write(self.operator_token)
        command = [sys.executable, "-c", "import sys; from forkd_server.cli import main; sys.exit(main())",
                   *(forkd_args or ["serve", "--data-dir", self.data_dir]), "--token-file", token_file]
        environment = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                       "JUPYTER_RUNTIME_DIR": os.path.join(self.workdir, "rt")}
        for name in ("FORKD_TEST_RUN_DIR", "FORKD_CACHE_DIR", "FORKD_VM_CACHE"):
            if os.environ.get(name):
                environment[name] = os.environ[name]
        forkd_lines = FORKD_LINES.format(documented=documented_config(heading), command=command, environment=environment,
                                         **self.ports)
        self.config = os.path.join(self.workdir, "jupyterhub_config.py")
        with open(self.config, "w") as f:
            f.write(CONFIG.format(workdir=self.workdir, proxy=PROXY, tester_token=self.tester_token,
                                  forkd_lines=forkd_lines, **self.ports))
        self.log = open(os.path.join(self.workdir, "hub.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", self.config], cwd=self.workdir,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    # --- addresses ------------------------------------------------------------------------------

    @property
    def public(self) -> str:
        return f"http://127.0.0.1:{self.ports['public_port']}"

    @property
    def forkd_url(self) -> str:
        """forkd through the Hub's proxy, as users reach it."""
        return f"{self.public}/services/forkd"

    @property
    def forkd_direct(self) -> str:
        """forkd on its own port (the proxy forwards the prefix unstripped)."""
        return f"http://127.0.0.1:{self.ports['forkd_port']}/services/forkd"

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    # --- the Hub's REST API, as the tester service -----------------------------------------------

    def api(self, method: str, path: str, body=None, token: str | None = None):
        return exchange(f"http://127.0.0.1:{self.ports['hub_port']}/hub/api{path}", method, body,
                        {"Authorization": f"token {token or self.tester_token}"})

    def wait_ready(self, timeout: float = 120) -> None:
        """Bounded polling until the Hub's API answers and forkd answers through the proxy."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyterhub exited {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.forkd_url}/healthz", timeout=2) as r:
                    if json.loads(r.read()).get("ok") and self.api("GET", "/")[0] == 200:
                        return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the Hub or forkd did not come up within {timeout} s:\n{self.output()}")
            time.sleep(0.1)

    def ctl(self, name: str):
        """The SDK as user ``name``, through the proxy (``tokens``: what the test made for each)."""
        from forkd_server.client import Controller
        return Controller(self.forkd_url, self.tokens[name])

    def user_token(self, name: str) -> str:
        status, body = self.api("POST", f"/users/{name}/tokens", {"note": "forkd tests", "expires_in": 3600})
        assert status == 201, (status, body)
        return body["token"]

    def start_server(self, name: str, timeout: float = 120) -> None:
        status, body = self.api("POST", f"/users/{name}/server")
        assert status in (201, 202), (status, body)
        deadline = time.monotonic() + timeout
        while True:
            model = self.api("GET", f"/users/{name}")[1]
            server = (model.get("servers") or {}).get("", {})
            if server.get("ready"):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}'s server did not start within {timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Delete what forkd holds, stop the Hub (which stops its proxy, its services and the users'
        servers), and make sure each is gone."""
        try:
            if self.proc.poll() is None:
                cleanup(self.forkd_direct, self.operator_token)
        finally:
            forkd_pid = _pid_from_lock(self.data_dir)
            proxy_pid = _pid_file(os.path.join(self.workdir, "jupyterhub-proxy.pid"))
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            for pid in (forkd_pid, proxy_pid, *_started_in(self.workdir)):
                _end(pid)
            try:  # whatever else is left in the Hub's session (a user's server)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.log.close()
            shutil.rmtree(self.workdir, ignore_errors=True)


def raw(hub: Hub, who: str | None, method: str, path: str, body=None, token: str | None = None,
        host: str | None = None):
    """One request through the Hub's proxy as ``who`` (or with ``token``); (status, parsed body).
    ``host``: the Host header a client of the Hub's public name sends."""
    headers = {"Host": host} if host else {}
    token = token or (hub.tokens[who] if who else None)
    if token:
        headers["Authorization"] = f"token {token}"
    return exchange(hub.forkd_url + path, method, body, headers)


def check_workspaces_are_their_makers(hub: Hub, base: str, not_found: str) -> None:
    """alice's workspace, its live sandbox and its suspended state are hers; bob gets ``not_found``
    (the 404's words) for it on every workspace route and 404 for its state; a resume stays hers."""
    alice, bob = hub.ctl("alice"), hub.ctl("bob")
    made = alice.create_workspace("alice-ws", base)
    try:
        assert made["labels"]["forkd.owner"] == "alice"
        assert alice.get_sandbox(made["live_sandbox_id"])["labels"]["forkd.owner"] == "alice"
        assert "alice-ws" in {w["name"] for w in alice.list_workspaces()}
        assert "alice-ws" not in {w["name"] for w in bob.list_workspaces()}
        for method, path in (("GET", "/v1/workspaces/alice-ws"), ("POST", "/v1/workspaces/alice-ws/suspend"),
                             ("DELETE", "/v1/workspaces/alice-ws")):
            status, body = raw(hub, "bob", method, path, {} if method == "POST" else None)
            assert (status, body) == (404, {"error": not_found}), (method, path, status, body)
        suspended = alice.suspend_workspace("alice-ws")
        state = alice.snapshot_info(suspended["current_state_tag"])
        assert state["labels"]["forkd.owner"] == "alice"
        assert raw(hub, "bob", "GET", f"/v1/snapshots/{state['tag']}/info")[0] == 404
        resumed = alice.resume_workspace("alice-ws")
        assert alice.get_sandbox(resumed["live_sandbox_id"])["labels"]["forkd.owner"] == "alice"
    finally:
        alice.delete_workspace("alice-ws")


def _pid_file(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def server_environment(hub: Hub, name: str) -> dict:
    """The environment of ``name``'s single-user server, read from /proc (it runs on this host)."""
    api = f"JUPYTERHUB_API_URL=http://127.0.0.1:{hub.ports['hub_port']}/hub/api".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                items = f.read().split(b"\0")
        except OSError:
            continue
        if api in items and f"JUPYTERHUB_USER={name}".encode() in items:
            return dict(i.decode().split("=", 1) for i in items if b"=" in i)
    raise AssertionError(f"no single-user server of {name} found")


def _started_in(workdir: str) -> list[int]:
    """Processes whose command line names ``workdir`` (the service the Hub ran, if it outlived it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if workdir.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _pid_from_lock(data_dir: str) -> int | None:
    """The pid of the forkd server on ``data_dir`` (datadir_lock.py writes it), if it is running."""
    try:
        from forkd_server.controller.datadir_lock import LOCK_NAME
        with open(os.path.join(data_dir, LOCK_NAME)) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def _end(pid: int | None, timeout: float = 30) -> None:
    """SIGTERM ``pid`` if it still runs, then SIGKILL after ``timeout``."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
