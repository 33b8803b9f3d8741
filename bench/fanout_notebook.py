"""``kids = %forkd fork -n 5`` of a notebook on the forkd kernel, paired with a raw fork of 5
(``bench/fanout.py --notebook``).

A ``forkd serve`` and a forkd kernel; the notebook holds numpy and a 64 MiB array. Each round a
cell changes the notebook's state first (so the fork takes a new branch of it, as after any cell
of a user's), then ``kids = %forkd fork -n 5`` runs as a cell, and the round is timed until the
five new sandboxes have answered a ping; they are killed after. The baseline is ``bench/raw_fork.py
5 64 --ipython``: a process holding an IPython shell, numpy and the array forks 5 children that
answer a ping.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from jupyter_client.manager import start_new_kernel  # noqa: E402

from bench.kernel import execute, fork_five  # noqa: E402 - the kernel bench's cell and fork of five
from tests.kernel.conftest import ServerForKernels  # noqa: E402 - a forkd serve the kernels find


def _raw() -> dict:
    out = subprocess.run([sys.executable, os.path.join(HERE, "raw_fork.py"), "5", "64", "--ipython"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def notebook_fork5(rounds: int) -> dict:
    server = ServerForKernels()
    from forkd_server.client import Controller
    ctl = Controller(server.url, server.token)
    try:
        km, kc = start_new_kernel(kernel_name="forkd-python")
        try:
            execute(kc, "import numpy as np\ndata = np.ones(64 * 2**20 // 8)\nstep = 0")
            ours, limit = [], []

            def fork() -> float:
                execute(kc, "step += 1")
                ms, kids = fork_five(kc, ctl)
                for sb in kids:
                    ctl.kill_sandbox(sb)
                return ms

            fork()  # warm: the kernel's first fork imports what later ones reuse
            for i in range(rounds):
                pair = [lambda: ours.append(fork()), lambda: limit.append(_raw()["total_ms"])]
                for run in (pair if i % 2 == 0 else pair[::-1]):
                    run()
                print(f"  notebook fork -n 5 round {i + 1}/{rounds}: ours {ours[-1]:.1f} ms, limit {limit[-1]:.1f} ms",
                      file=sys.stderr)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    finally:
        server.stop()
    out = {"ours_total_ms": statistics.median(ours), "limit_total_ms": statistics.median(limit),
           "ours_runs_ms": [round(x, 1) for x in ours], "limit_runs_ms": [round(x, 1) for x in limit]}
    out["ratio"] = out["ours_total_ms"] / out["limit_total_ms"]
    return out
