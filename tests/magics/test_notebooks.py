"""The demo notebooks under nbval (strict: every output compared, after sanitizing ids and timings),
each on a fresh kernel, against the real ``forkd serve`` this session started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"
SANITIZE = NOTEBOOKS / "nbval-sanitize.cfg"
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_the_demo_notebooks_are_there():
    assert ALL == ["agent-mid-thought.ipynb", "hyperparameter-fanout.ipynb", "quickstart.ipynb",
                   "safe-destructive-operation.ipynb", "time-travel.ipynb"]


@pytest.mark.parametrize("name", ALL)
def test_notebook_under_nbval(forkd, name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    on_forkd_kernel = nb.metadata.get("kernelspec", {}).get("name") == "forkd-python"
    if not on_forkd_kernel:
        assert code[0].source == "%load_ext forkd_magics"
    assert all(c.outputs or c.source.startswith("%load_ext") or "=" in c.source.splitlines()[-1]
               for c in code), "stored outputs are what nbval compares: run the notebook before committing it"
    # A notebook on the forkd kernel runs on that kernel (its kernelspec); the others in this environment.
    current_env = [] if on_forkd_kernel else ["--nbval-current-env"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", *current_env,
         "--nbval-sanitize-with", str(SANITIZE), "--nbval-cell-timeout", "120", str(NOTEBOOKS / name)],
        env=forkd.env, cwd=NOTEBOOKS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert f"{len(code)} passed" in proc.stdout
    # the notebook cleaned up after itself (a forkd kernel's shutdown frees its own sandbox; its base
    # snapshot stays for the next forkd kernel)
    ctl = forkd.controller()
    left = [s["tag"] for s in ctl.list_snapshots()]
    assert left == ([t for t in left if t.startswith("forkd-kernel-")] if on_forkd_kernel else [])
    if on_forkd_kernel:
        # nbval kills its kernel without a shutdown request, as a crash would: the notebook's own
        # sandbox (its HEAD, recorded with the server) is all that is left, and it is still running.
        heads = {k["head"] for k in ctl.list_kernels()}
        assert {s["id"] for s in ctl.list_sandboxes()} == heads and len(heads) == 1
        for kernel in ctl.list_kernels():
            ctl.kill_sandbox(kernel["head"])
            ctl.forget_kernel(kernel["kernel_id"])
    assert ctl.list_sandboxes() == []
