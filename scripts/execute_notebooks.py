"""Run the demo notebooks against a fresh ``forkd serve`` and store their outputs (what nbval compares).

    python3 scripts/execute_notebooks.py                 # every notebook in notebooks/
    python3 scripts/execute_notebooks.py quickstart      # one (name without .ipynb)

Each notebook runs on the kernel its metadata names (``python3``, or ``forkd-python`` for the ones
that run on the forkd kernel), with ``$JPY_SESSION_NAME`` set as Jupyter sets it (the magics label what
they make with it: "this notebook"), then everything the server still holds is deleted and it stops.
A notebook whose metadata says ``"forkd": {"server": "jupyter"}`` (it opens a notebook on the forkd
kernel through Jupyter's sessions API, and reaches the MCP server) runs against a ``jupyter server``
with forkd of its own instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nbformat  # noqa: E402

from tests.kernel.conftest import ServerForKernels  # noqa: E402 - after the path is set
from tests.serving import JupyterServer  # noqa: E402


def needs_jupyter(path: Path) -> bool:
    return nbformat.read(path, as_version=4).metadata.get("forkd", {}).get("server") == "jupyter"


def main(names: list[str]) -> int:
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if names:
        notebooks = [p for p in notebooks if p.stem in names]
    server = ServerForKernels()  # exports FORKD_URL / FORKD_TOKEN to the kernels started below
    failed = 0
    try:
        for path in notebooks:
            print(f"executing {path.name} ...", flush=True)
            env = {**os.environ, "JPY_SESSION_NAME": f"notebooks/{path.name}"}
            jupyter = JupyterServer() if needs_jupyter(path) else None
            if jupyter is not None:
                env.update(FORKD_URL=jupyter.forkd_url, FORKD_TOKEN=jupyter.token)
            try:
                done = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                                       "--inplace", "--ExecutePreprocessor.timeout=300", str(path)],
                                      cwd=path.parent, env=env)
            finally:
                if jupyter is not None:
                    jupyter.stop()
            failed += done.returncode != 0
    finally:
        server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
