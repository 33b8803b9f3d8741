"""A notebook's fork of 5, stage by stage, inside the branch's new template and its first child.

    python3 bench/fork_stages.py [--rounds 5] [--json]

A Controller in this process; a sandbox of a snapshot with the IPython shell (as the forkd kernel's
HEAD) that made numpy and a 64 MiB array in a cell, as ``bench/fanout_notebook.py``'s notebook does.
A cell run in it (``PROBE``) wraps the engine's steps by module attribute with timestamps, so the
fork's copies carry them: the branch's new template stamps its set-up (its PID 1 handing over to
forkd-init, the wait for its cgroup move, the /tmp and /dev/shm copies, the repairs, the fork plan,
the prewarm, its ready report), and the first child of the spawn that follows stamps its own.
Nothing of this is in the engine. Every stamp is ``time.monotonic()`` (one clock for the host and
every sandbox), in ms from the start of the fork (its branch, then its spawn of 5); medians over
the rounds, one warm-up round first.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from forkd_server.controller import Controller  # noqa: E402

PROBE = r'''
import time as _t
import forkd_engine.agent.inventory as _inventory
import forkd_engine.process.inside as _inside
_marks = []
def _wrap(owner, attr):
    inner = getattr(owner, attr)
    def wrapped(*args, **kwargs):
        mark = [attr, _t.monotonic(), None]  # a step that forks: its copy has no end
        _marks.append(mark)
        result = inner(*args, **kwargs)
        mark[2] = _t.monotonic()
        return result
    setattr(owner, attr, wrapped)
for _owner, _attr in [(_inside, "hand_pid1_to_init"), (_inside, "wait_to_be_moved"), (_inside, "private_copy"),
                      (_inventory, "repair_after_fork"), (_inventory, "fork_plan"), (_inside, "prewarm_for_forks"),
                      (_inside, "report_ready"), (_inside.SandboxProcess, "_fork_into_new_pidns"),
                      (_inside.SandboxProcess, "spawn"), (_inside.SandboxProcess, "become")]:
    _wrap(_owner, _attr)
'''


def one_fork(ctl: Controller, source: str) -> dict:
    """ms from the start of the fork: the host's branch and spawn, and the stamps its first child
    carries: the source's fork, the template's steps up to its spawn, then the child's own."""
    ctl.run_code(source, "_marks.clear()")
    out = {}
    t0 = time.monotonic()
    snapshot = ctl.branch(source, f"stages-{time.time_ns()}", mode="live")
    out["host: the branch is ready"] = (time.monotonic() - t0) * 1000
    kids = ctl.spawn(snapshot["tag"], 5)
    out["host: 5 children running"] = (time.monotonic() - t0) * 1000
    marks = ast.literal_eval(ctl.eval(kids[0]["id"], "_marks")["result"])
    for kid in kids:
        ctl.kill_sandbox(kid["id"])
    ctl.delete_snapshot(snapshot["tag"])
    who, seen = "source", defaultdict(int)
    for name, start, end in marks:
        who = {"become": "template" if who == "source" else who, "spawn": "template"}.get(name, who)
        seen[who, name] += 1
        key = f"{who}: {name}" + (f" #{seen[who, name]}" if name in ("private_copy", "fork_plan") else "")
        out[key + " starts"] = (start - t0) * 1000
        if end is not None:
            out[key + " takes"] = (end - start) * 1000
        if name == "spawn":
            who = "child"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fks") as data_dir:
        ctl = Controller(data_dir)
        try:
            ctl.create_snapshot("stages", shell="ipython", setup="import numpy as np")
            source = ctl.spawn("stages", 1)[0]["id"]
            ctl.run_code(source, "data = np.ones(64 * 2**20 // 8)")
            ctl.run_code(source, PROBE)
            one_fork(ctl, source)  # warm
            rounds = [one_fork(ctl, source) for _ in range(args.rounds)]
            ctl.kill_sandbox(source)
            ctl.delete_snapshot("stages")
        finally:
            ctl.close()
    keys = list(dict.fromkeys(k for r in rounds for k in r))
    medians = {k: round(statistics.median(r[k] for r in rounds if k in r), 1) for k in keys}
    out = {"load": os.getloadavg(), "rounds": args.rounds, "median_ms": medians}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k in keys:
            print(f"{medians[k]:8.1f} ms  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
