"""Kishu's checkpoint and checkout of the state ``bench/kernel.py`` branches, in a plain ipykernel.

Kishu (``pip install kishu``, the ``bench`` extra) is the Jupyter checkpointing tool closest to
``%forkd branch``: its IPython extension commits the notebook's variables after every cell
(pickling what changed into a SQLite database beside the notebook) and ``checkout`` restores a
commit's variables by unpickling them. Here it runs as a user would in a kernel started with
jupyter_client, driven cell by cell like ``bench/kernel.py`` drives the forkd kernel:

1. ``big = np.ones(...)`` (``gib`` GiB of float64), then ``init_kishu(notebook)``;
2. ``big += 1.0`` twice: each cell's auto-commit checkpoints the rewritten array. ``checkpoint_ms``
   is what Kishu adds to the second cell (its round trip minus the cell's own run time, which Kishu
   records), ``kishu_checkpoint_ms`` the part Kishu itself times as its checkpoint;
3. ``_kishu.checkout(<first commit>)``: ``checkout_ms`` is the call, timed inside the cell;
   ``checkout_cell_ms`` the whole cell (Kishu commits again after it). The restored ``big`` is
   checked to hold the first commit's values, so a figure never stands for a wrong restore.

Kishu runs in its test mode (``ENV_KISHU_TEST_MODE``): outside a browser there is no frontend
through which it could save the notebook, which is all that mode skips.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

FLOATS_PER_GIB = 2**27


def _run(kc, code: str, timeout: float = 1200) -> tuple[float, str]:
    """(round trip in ms, printed text) of one cell; raises when the cell fails."""
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    t0 = time.perf_counter()
    reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    ms = (time.perf_counter() - t0) * 1000
    content = reply["content"]
    if content["status"] != "ok":
        raise RuntimeError(f"Kishu cell {code!r} failed: {content.get('ename')}: {content.get('evalue')}")
    return ms, "".join(out)


def kishu_figures(gib: float = 1) -> dict:
    try:
        import kishu  # noqa: PLC0415 - only to say which version, and that it is installed here
    except ImportError:
        raise RuntimeError("kishu is not installed: pip install kishu (or this project's 'bench' extra)") from None
    import nbformat  # noqa: PLC0415
    from jupyter_client.manager import start_new_kernel  # noqa: PLC0415

    workdir = tempfile.mkdtemp(prefix="kishu-bench-")
    notebook = os.path.join(workdir, "bench.ipynb")
    nbformat.write(nbformat.v4.new_notebook(), notebook)
    env = {**os.environ, "ENV_KISHU_TEST_MODE": "1", "KISHU_PATH_ROOT": workdir,
           "TEST_NOTEBOOK_PATH": notebook}
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=workdir)
    try:
        n = int(FLOATS_PER_GIB * gib)
        _run(kc, f"import numpy as np\nbig = np.ones({n})")
        # The cell that attaches Kishu has no pre-run hook of Kishu's: its own post-run commit fails
        # (PostWithoutPreError, printed by IPython) and Kishu starts from the next cell, as in a notebook.
        _run(kc, f"from kishu import init_kishu\ninit_kishu({notebook!r})")
        _run(kc, "big += 1.0")  # commit 1: big == 2 (Kishu's first commit stores the whole namespace)
        _, first = _run(kc, "print(_kishu._kishu_branch.get_head().commit_id)")
        first = first.strip()
        cell_ms, _ = _run(kc, "big += 1.0")  # commit 2: big == 3, the checkpoint measured
        _, info = _run(kc, "_e = _kishu._kishu_commit.get_commit(_kishu._kishu_branch.get_head().commit_id)\n"
                           "print(_e.end_time - _e.start_time, _e.checkpoint_runtime_s)")
        run_s, checkpoint_s = (float(x) for x in info.split())
        # The checkout replaces the namespace, so the timer lives in builtins.
        checkout_cell_ms, printed = _run(
            kc, "import builtins, time\nbuiltins._kishu_t0 = time.perf_counter()\n"
                f"_kishu.checkout({first!r})\n"
                "print((__import__('time').perf_counter() - __import__('builtins')._kishu_t0) * 1000, big[0], big[-1])")
        checkout_ms, head, tail = (float(x) for x in printed.split())
        if head != 2.0 or tail != 2.0:
            raise RuntimeError(f"Kishu's checkout of {first} restored big[0], big[-1] = {head}, {tail}, not 2.0")
        return {"version": kishu.__version__, "state_gib": gib,
                "checkpoint_ms": round(cell_ms - run_s * 1000, 1),
                "kishu_checkpoint_ms": round(checkpoint_s * 1000, 1),
                "checkout_ms": round(checkout_ms, 1), "checkout_cell_ms": round(checkout_cell_ms, 1),
                "restored": "exact (big == 2.0 after checking out commit 1)"}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(kishu_figures(float(sys.argv[1]) if len(sys.argv) > 1 else 1), indent=1))
