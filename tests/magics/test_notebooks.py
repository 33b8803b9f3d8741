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


def test_the_four_demo_notebooks_are_there():
    assert ALL == ["agent-mid-thought.ipynb", "hyperparameter-fanout.ipynb", "quickstart.ipynb",
                   "safe-destructive-operation.ipynb"]


@pytest.mark.parametrize("name", ALL)
def test_notebook_under_nbval(forkd, name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source == "%load_ext forkd_magics"
    assert all(c.outputs or c.source.startswith("%load_ext") or "=" in c.source.splitlines()[-1]
               for c in code), "stored outputs are what nbval compares: run the notebook before committing it"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
         "--nbval-sanitize-with", str(SANITIZE), "--nbval-cell-timeout", "120", str(NOTEBOOKS / name)],
        env=forkd.env, cwd=NOTEBOOKS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert f"{len(code)} passed" in proc.stdout
    # the notebook cleaned up after itself
    ctl = forkd.controller()
    assert ctl.list_sandboxes() == [] and ctl.list_snapshots() == []
