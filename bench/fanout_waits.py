"""Where the wall time of a small fan-out goes when the CPU is not the bound: ``spawn(10)`` and a
notebook-style ``fork(5)`` (a branch of a running sandbox, then 5 children), stage by stage.

    python3 bench/fanout_waits.py [--rounds 4] [--json]

A Controller in this process; the bench wraps the host's steps with timestamps (by attribute, as
``fanout_profile.py`` does; nothing of this is in the engine): each registry transaction (with
whether it waited for the disk), the template's spawn call, the reports, each write to a
``cgroup.procs`` (the first of a burst waits for an RCU grace period), the branch's wait for its new
template. After each spawn it reads ``/proc/PID/schedstat`` of every child's init (whose figures
include the namespace's first process before its exec: the fork of the agent) and agent: CPU and
time spent runnable but waiting for a CPU. Medians over the rounds, one warm-up round first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from forkd_engine import cgroups  # noqa: E402
from forkd_engine.process import engine as process_engine  # noqa: E402
from forkd_server.controller import registry  # noqa: E402
from forkd_server.controller import Controller  # noqa: E402

SETUP = "import numpy\ndata = numpy.ones({mib} * 2**20 // 8)\n"


class Stamps:
    """(stage, start, end) of every wrapped step since the last ``clear``."""

    def __init__(self):
        self.marks: list[tuple[str, float, float]] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        static = isinstance(owner.__dict__.get(attr), staticmethod)

        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.marks.append((name, t0, time.perf_counter()))
        setattr(owner, attr, staticmethod(wrapped) if static else wrapped)

    def attach(self) -> None:
        tx = registry.Registry.tx
        marks = self.marks

        @contextlib.contextmanager
        def timed_tx(reg, durable: bool = True):
            t0 = time.perf_counter()
            with tx(reg, durable) as db:
                yield db
            marks.append(("registry commit, " + ("fsync" if durable else "no fsync"), t0, time.perf_counter()))
        registry.Registry.tx = timed_tx
        join = cgroups.Cgroups.join

        def timed_join(leaves, pid):  # each write on its own: the first of a burst waits for RCU
            for leaf in leaves:
                for one in pid if isinstance(pid, list) else [pid]:
                    t0 = time.perf_counter()
                    join([leaf], one)
                    marks.append(("cgroup.procs write", t0, time.perf_counter()))
        cgroups.Cgroups.join = staticmethod(timed_join)
        self.wrap(cgroups.Cgroups, "move", "cgroup move (a branch's new template)")
        self.wrap(process_engine.ProcessEngine, "_read_report", "report read (waits for a child)")
        self.wrap(process_engine.ProcessEngine, "call", "template/sandbox call (the fork loop, a branch's fork)")

    def clear(self) -> None:
        self.marks.clear()

    def summary(self, t0: float) -> dict:
        out: dict = {}
        for name, a, b in self.marks:
            s = out.setdefault(name, {"count": 0, "sum_ms": 0.0, "max_ms": 0.0})
            s["count"] += 1
            s["sum_ms"] += (b - a) * 1000
            s["max_ms"] = max(s["max_ms"], (b - a) * 1000)
        return out


def schedstat(pid: int) -> tuple[float, float]:
    """(CPU ms, ms runnable but waiting for a CPU) of a process's main thread."""
    with open(f"/proc/{pid}/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run) / 1e6, int(wait) / 1e6


def children_sched(ctl: Controller, kids: list[dict]) -> dict:
    inits, agents = [], []
    for k in kids:
        h = ctl.registry.get_sandbox(k["id"])["handle"]
        inits.append(schedstat(h["init"]["pid"]))
        agents.append(schedstat(h["pid"]))
    med = statistics.median
    return {"init_cpu_ms": med(x[0] for x in inits), "init_runqueue_ms": med(x[1] for x in inits),
            "agent_cpu_ms": med(x[0] for x in agents), "agent_runqueue_ms": med(x[1] for x in agents)}


def rounds_of(name: str, rounds: int, once) -> dict:
    rows = []
    for i in range(rounds + 1):
        row = once()
        if i:  # the first round warms up
            rows.append(row)
            print(f"  {name} round {i}/{rounds}: {row['total_ms']:.1f} ms, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    stages = sorted({s for r in rows for s in r["stages"]})
    return {"total_ms": statistics.median(r["total_ms"] for r in rows),
            "runs_ms": [round(r["total_ms"], 1) for r in rows],
            "children": {k: statistics.median(r["children"][k] for r in rows) for k in rows[0]["children"]},
            "stages_ms": {s: {k: statistics.median(r["stages"].get(s, {}).get(k, 0) for r in rows)
                              for k in ("count", "sum_ms", "max_ms")} for s in stages}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    stamps = Stamps()
    stamps.attach()
    out: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="fkw") as d:
        ctl = Controller(d)
        try:
            ctl.create_snapshot("waits200", setup=SETUP.format(mib=200))
            ctl.create_snapshot("waits64", setup=SETUP.format(mib=64))
            source = ctl.spawn("waits64", 1)[0]["id"]

            def spawn10() -> dict:
                stamps.clear()
                t0 = time.perf_counter()
                kids = ctl.spawn("waits200", 10)
                total = time.perf_counter() - t0
                row = {"total_ms": total * 1000, "stages": stamps.summary(t0), "children": children_sched(ctl, kids)}
                for k in kids:
                    ctl.kill_sandbox(k["id"])
                return row

            def fork5() -> dict:
                ctl.eval(source, "data[0] += 1")  # a cell ran since the last branch, as in a notebook
                stamps.clear()
                t0 = time.perf_counter()
                tree = ctl.fork(source, 5)
                total = time.perf_counter() - t0
                row = {"total_ms": total * 1000, "stages": stamps.summary(t0),
                       "children": children_sched(ctl, tree["sandboxes"])}
                for k in tree["sandboxes"]:
                    ctl.kill_sandbox(k["id"])
                with contextlib.suppress(Exception):
                    ctl.delete_snapshot(tree["snapshot"]["tag"])
                return row

            out["spawn10_200mib"] = rounds_of("spawn(10)", args.rounds, spawn10)
            out["fork5_64mib"] = rounds_of("fork(5)", args.rounds, fork5)
            ctl.kill_sandbox(source)
            for tag in ("waits200", "waits64"):
                ctl.delete_snapshot(tag)
        finally:
            ctl.close()
    out["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for name in ("spawn10_200mib", "fork5_64mib"):
        fig = out[name]
        print(f"{name}: median {fig['total_ms']:.1f} ms (runs {fig['runs_ms']})")
        for stage, s in fig["stages_ms"].items():
            print(f"  {stage:58s} x{s['count']:<4g} {s['sum_ms']:7.1f} ms (longest {s['max_ms']:.1f})")
        c = fig["children"]
        print(f"  per child, medians: init (first process + init) CPU {c['init_cpu_ms']:.2f} ms, waiting for a CPU "
              f"{c['init_runqueue_ms']:.2f} ms; agent CPU {c['agent_cpu_ms']:.2f} ms, waiting for a CPU "
              f"{c['agent_runqueue_ms']:.2f} ms")
    print(f"load {out['load_before'][0]:.1f} -> {out['load_after'][0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
