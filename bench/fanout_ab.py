"""Two versions of the engine side by side on ``spawn(n)``: CPU, USS and wall time, interleaved.

    python3 bench/fanout_ab.py BEFORE_TREE AFTER_TREE [--pairs 4] [--n 100] [--rounds 3]

Each tree is a checkout of the project (``git worktree add`` or ``git archive | tar -x``; not under
/tmp, which a sandbox sees as its own). For each pair, one process per tree runs in turn, the order
alternating so a trend in the load falls on both alike: it makes the ``fanout64`` snapshot with
that tree's code, warms it with a spawn of 10, and times ``rounds`` spawns of ``n`` children each
pinged, with this checkout's ``bench/fanout.py`` ``spawn_once`` (one method for both trees), then
an eval in each child, twice, 8 at a time as a fan-out's client would (``first_eval_ms``,
``second_eval_ms``: what a child's first use costs; ``..._all_ms``: each round's whole time).
Printed: each process's medians, then the medians over the pairs and the ratio after / before,
with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# Runs in the tree's own interpreter: its controller, engine and bench helpers.
ONE = r'''
import json, os, statistics, sys, tempfile
tree, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, sys.argv[5])  # this checkout's bench
from fanout import SETUP, spawn_once
from forkd_server.controller import Controller
with tempfile.TemporaryDirectory(prefix="fkab", dir=sys.argv[4]) as data_dir:
    ctl = Controller(data_dir)
    try:
        ctl.create_snapshot("fanout64", setup=SETUP.format(mib=64))
        try:
            spawn_once(ctl, "fanout64", 10)
            rows = [spawn_once(ctl, "fanout64", n, memory=True, first_eval=True) for _ in range(rounds)]
        finally:
            ctl.delete_snapshot("fanout64")
    finally:
        ctl.close()
med = lambda key: statistics.median(r[key] for r in rows)
print(json.dumps({"total_ms": med("total_ms"), "cpu_ms": med("cpu_ms"), "uss_mib": med("uss_mib"),
                  "pss_mib": med("pss_mib"), "first_eval_ms": med("first_eval_ms"),
                  "second_eval_ms": med("second_eval_ms"), "first_eval_all_ms": med("first_eval_all_ms"),
                  "second_eval_all_ms": med("second_eval_all_ms"), "load": os.getloadavg()[0],
                  "cpu_split_ms": {k: statistics.median(r["cpu_split_ms"][k] for r in rows) for k in rows[0]["cpu_split_ms"]}}))
'''


def one(tree: str, n: int, rounds: int, data_parent: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree}:{tree}/engine")
    out = subprocess.run([sys.executable, "-c", ONE, tree, str(n), str(rounds), data_parent, HERE], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-parent", default=os.path.dirname(os.path.abspath(HERE)),
                        help="where each run's data directory is made (not /tmp)")
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.pairs):
        for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
            runs[side].append(one(trees[side], args.n, args.rounds, args.data_parent))
            r = runs[side][-1]
            print(f"  pair {i + 1} {side}: CPU {r['cpu_ms']:.0f} ms, USS {r['uss_mib']:.2f} MiB, "
                  f"all answered {r['total_ms']:.0f} ms, first evals {r['first_eval_ms']:.2f} ms "
                  f"(all {r['first_eval_all_ms']:.0f} ms), second {r['second_eval_ms']:.2f} ms "
                  f"(all {r['second_eval_all_ms']:.0f} ms) (load {r['load']:.1f})", file=sys.stderr)
    out = {"n": args.n, "trees": trees}
    for key in ("cpu_ms", "uss_mib", "pss_mib", "total_ms", "first_eval_ms", "second_eval_ms", "first_eval_all_ms",
                "second_eval_all_ms"):
        before, after = (statistics.median(r[key] for r in runs[s]) for s in ("before", "after"))
        out[key] = {"before": before, "after": after, "ratio": after / before}
    out["cpu_split_ms"] = {s: {k: statistics.median(r["cpu_split_ms"][k] for r in runs[s]) for k in runs[s][0]["cpu_split_ms"]}
                           for s in runs}
    out["load"] = [r["load"] for s in runs for r in runs[s]]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
