"""The demo notebooks under nbval (strict: every output compared, after sanitizing ids, timings and
measured sizes), each on a fresh kernel, against the real ``forkd serve`` this session started, with
``$JPY_SESSION_NAME`` set as Jupyter sets it for a notebook's kernel. Each starts by removing what an
earlier run of it left, so it passes again after a run that was cut short."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager

from forkd_server.client import Controller

from ..serving import JupyterServer

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"
SANITIZE = NOTEBOOKS / "nbval-sanitize.cfg"
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
FRESH_START = "%forkd kill --all"

pytestmark = pytest.mark.slow  # a whole notebook per test, ~10 s each


def test_the_demo_notebooks_are_there():
    assert ALL == ["agent-forks-a-notebook.ipynb", "agent-mid-thought.ipynb", "hyperparameter-fanout.ipynb",
                   "quickstart.ipynb",
                   "safe-destructive-operation.ipynb", "time-travel.ipynb", "what-a-fork-costs.ipynb"]


def env_of(forkd, name: str) -> dict:
    # nbval ignores display updates: a %%forkd run that took over a second (a loaded machine) would
    # leave its live columns in the outputs it compares, so the columns stay off
    return {**forkd.env, "JPY_SESSION_NAME": f"notebooks/{name}", "FORKD_RUN_SHOW_AFTER": "inf"}


def under_nbval(forkd, name: str) -> None:
    """Run one notebook under strict nbval; it must pass and leave the server as it found it."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    on_forkd_kernel = nb.metadata.get("kernelspec", {}).get("name") == "forkd-python"
    first = code[0].source.splitlines()
    assert (first[0] == "%load_ext forkd_magics" or on_forkd_kernel) and any(
        line.startswith(FRESH_START) for line in first), "a demo starts by removing what an earlier run left"
    assert all(c.outputs or "=" in c.source.splitlines()[-1] for c in code), \
        "stored outputs are what nbval compares: run scripts/execute_notebooks.py before committing"
    # A notebook on the forkd kernel runs on that kernel (its kernelspec); the others in this environment.
    current_env = [] if on_forkd_kernel else ["--nbval-current-env"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", *current_env,
         "--nbval-sanitize-with", str(SANITIZE), "--nbval-cell-timeout", "120", str(NOTEBOOKS / name)],
        env=env_of(forkd, name), cwd=NOTEBOOKS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert f"{len(code)} passed" in proc.stdout
    # the notebook cleaned up after itself (a forkd kernel's shutdown frees its own sandbox; its base
    # snapshot stays for the next forkd kernel)
    ctl = forkd.controller()
    left = [s["tag"] for s in ctl.list_snapshots()]
    opens_forkd_kernel = on_forkd_kernel or needs_jupyter(nb)
    assert left == ([t for t in left if t.startswith("forkd-kernel-")] if opens_forkd_kernel else [])
    if on_forkd_kernel:
        # nbval kills its kernel without a shutdown request, as a crash would: the notebook's own
        # sandbox (its HEAD, recorded with the server) is all that is left, and it is still running.
        heads = {k["head"] for k in ctl.list_kernels()}
        assert {s["id"] for s in ctl.list_sandboxes()} == heads and len(heads) == 1
        for kernel in ctl.list_kernels():
            ctl.kill_sandbox(kernel["head"])
            ctl.forget_kernel(kernel["kernel_id"])
    assert ctl.list_sandboxes() == []


def needs_jupyter(nb) -> bool:
    """A notebook that opens a notebook on the forkd kernel through Jupyter's sessions API (and talks
    to the MCP server of the Jupyter server it runs in) runs against a ``jupyter server`` of its own."""
    return nb.metadata.get("forkd", {}).get("server") == "jupyter"


class InJupyter:
    """A ``jupyter server`` with forkd (``tests.serving.JupyterServer``), as ``under_nbval`` uses a server."""

    def __init__(self):
        self.server = JupyterServer()

    @property
    def env(self) -> dict:
        return {**os.environ, "FORKD_URL": self.server.forkd_url, "FORKD_TOKEN": self.server.token}

    def controller(self) -> Controller:
        return Controller(self.server.forkd_url, self.server.token)


@pytest.mark.parametrize("name", ALL)
def test_notebook_under_nbval(forkd, name):
    if not needs_jupyter(nbformat.read(NOTEBOOKS / name, as_version=4)):
        under_nbval(forkd, name)
        return
    jupyter = InJupyter()
    try:
        under_nbval(jupyter, name)
        assert jupyter.controller().list_kernels() == []  # the notebook it opened was closed, its kernel gone
    finally:
        jupyter.server.stop()


def test_a_notebook_cut_short_runs_again(forkd):
    """Run the quickstart's cells up to its branch in a kernel, kill the kernel (what is made stays on
    the server, as after a crash or an interrupted "Run all"), then run the whole notebook again."""
    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    upto = next(i for i, src in enumerate(code) if src.startswith("branch.wait()"))
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env_of(forkd, "quickstart.ipynb"), cwd=str(NOTEBOOKS))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        for src in code[:upto + 1]:
            assert kc.execute_interactive(src, timeout=120, output_hook=lambda m: None)["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    ctl = forkd.controller()
    assert sorted(s["tag"] for s in ctl.list_snapshots()) == ["quickstart", "quickstart-b1"]
    assert len(ctl.list_sandboxes()) == 3
    under_nbval(forkd, "quickstart.ipynb")
