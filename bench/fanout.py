"""Fan-out against the physical limit, in one run (process engine, real sandboxes, this machine).

    python3 bench/fanout.py                 # a table
    python3 bench/fanout.py --json          # one JSON object
    python3 bench/fanout.py --profile       # where one spawn(n=100) spends its time, stage by stage

Every figure is paired with its baseline, measured in the same run, interleaved round by round
(``--rounds``), and given as the median of the rounds and the ratio of the medians:

- ``spawn_n100`` / ``spawn_n500``: ``Controller.spawn(tag, n)`` until every child has answered a
  ping (through the controller, one after the other), against ``bench/raw_fork.py``: ``os.fork()``
  of the same workload (numpy and a 64 MiB array) whose children answer a ping over a socket
  pair. ``call_ms`` is the spawn call alone, against the raw forks alone. ``cpu_ms`` is the CPU
  time the whole fan-out took, summed over every process that took part (the bench's own, by
  getrusage; the template's, each child's agent's and init's, by schedstat, whose threads that
  ended by then, such as a ping's connection thread, are not counted; the raw parent and its
  children): on a loaded machine, where wall time mostly says how long others ran, the steadier
  figure. ``cpu_split_ms`` says whose.
- USS per idle child (``ours_uss_mib``, ``limit_uss_mib``, ``uss_ratio`` in ``spawn_n100``):
  Private_Clean + Private_Dirty of an idle child (median over the n = 100 children; a sandbox's
  figure includes its init), against a raw fork child's.
- ``ours_first_eval_ms`` / ``ours_second_eval_ms`` (in ``spawn_n100``, after the USS is read): an
  eval of ``1`` in each child, 8 at a time, medians, and ``..._all_ms`` the whole round; a child
  idles in the template's fork loop until its first request other than a ping, which then pays its
  set-up.
- ``demo_fork10``: ``forkd demo``'s fork (10 children of numpy and a 200 MiB array, each answering a
  ping), against a raw fork of 10 of the same workload.
- ``vm_restore``: a VM sandbox's restore to a confirmed agent (256 MiB guest), against a bare QEMU
  restore of the same snapshot with the engine's own command line until QEMU reports it loaded
  (``bench/vm_restore.py``, which also gives the split: QEMU's start and load, the guest's run to
  the agent's reply, the host's work). Left out with ``--no-vm`` or where QEMU is not installed.
- ``notebook_fork5``: ``kids = %forkd fork -n 5`` in a notebook on the forkd kernel
  until the five answer a ping (a forkd serve, a kernel), against a raw fork of 5 of a process
  holding IPython and numpy.

The load average is printed with the figures: on a shared machine, only ratios of one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from forkd_server.controller import Controller  # noqa: E402
from forkd_server.doctor import check_cgroup_moves  # noqa: E402

from raw_fork import cpu_ns, own_cpu_ns  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SETUP = "import numpy\ndata = numpy.ones({mib} * 2**20 // 8)\n"


def raw(n: int, mib: int = 64) -> dict:
    out = subprocess.run([sys.executable, os.path.join(HERE, "raw_fork.py"), str(n), str(mib)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def spawn_once(ctl: Controller, tag: str, n: int, memory: bool = False, first_eval: bool = False) -> dict:
    template = ctl.registry.get_snapshot(tag)["handle"]["pid"]
    host0, template0 = own_cpu_ns(), cpu_ns(template)
    t0 = time.perf_counter()
    kids = ctl.spawn(tag, n)
    called = time.perf_counter()
    for k in kids:
        ctl.ping(k["id"])
    total = time.perf_counter()
    split = {"host": own_cpu_ns() - host0, "template": cpu_ns(template) - template0, "agents": 0, "inits": 0}
    for k in kids:
        handle = ctl.registry.get_sandbox(k["id"])["handle"]
        split["agents"] += cpu_ns(handle["pid"])
        split["inits"] += cpu_ns(handle["init"]["pid"])
    out = {"call_ms": (called - t0) * 1000, "total_ms": (total - t0) * 1000, "cpu_ms": sum(split.values()) / 1e6,
           "cpu_split_ms": {k: v / 1e6 for k, v in split.items()}}
    if memory:
        mem = [ctl.memory(k["id"]) for k in kids]
        out["uss_mib"] = statistics.median(m["uss_kib"] for m in mem) / 1024
        out["pss_mib"] = statistics.median(m["pss_kib"] for m in mem) / 1024
    if first_eval:  # what a child's first use costs (an idle child sets itself up for it), then its second
        def timed_eval(kid: dict) -> float:
            t = time.perf_counter()
            ctl.eval(kid["id"], "1")
            return (time.perf_counter() - t) * 1000

        with ThreadPoolExecutor(8) as pool:  # as a fan-out's client uses the children: 8 calls at a time
            for key in ("first_eval", "second_eval"):
                t = time.perf_counter()
                out[f"{key}_ms"] = statistics.median(pool.map(timed_eval, kids))
                out[f"{key}_all_ms"] = (time.perf_counter() - t) * 1000
    for k in kids:
        ctl.kill_sandbox(k["id"])
    return out


def paired(name: str, rounds: int, ours, limit) -> dict:
    """``rounds`` interleaved pairs of (ours, the limit); medians of each figure and their ratio."""
    a, b = [], []
    for i in range(rounds):
        if i % 2:  # alternate which goes first, so a trend in the load falls on both alike
            b.append(limit())
            a.append(ours())
        else:
            a.append(ours())
            b.append(limit())
        print(f"  {name} round {i + 1}/{rounds}: ours {a[-1]['total_ms']:.1f} ms ({a[-1].get('cpu_ms', 0):.0f} ms CPU), "
              f"limit {b[-1]['total_ms']:.1f} ms ({b[-1].get('cpu_ms', 0):.0f} ms CPU)",
              file=sys.stderr)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = {"ours_total_ms": med(a, "total_ms"), "limit_total_ms": med(b, "total_ms"),
           "ours_runs_ms": [round(r["total_ms"], 1) for r in a], "limit_runs_ms": [round(r["total_ms"], 1) for r in b]}
    out["ratio"] = out["ours_total_ms"] / out["limit_total_ms"]
    if "cpu_ms" in a[0]:
        out["ours_cpu_ms"], out["limit_cpu_ms"] = med(a, "cpu_ms"), med(b, "cpu_ms")
        out["ours_cpu_split_ms"] = {k: statistics.median(r["cpu_split_ms"][k] for r in a) for k in a[0]["cpu_split_ms"]}
        out["cpu_ratio"] = out["ours_cpu_ms"] / out["limit_cpu_ms"]
    if "call_ms" in a[0]:
        out["ours_call_ms"] = med(a, "call_ms")
        out["limit_fork_ms"] = med(b, "fork_ms")
        out["call_ratio"] = out["ours_call_ms"] / out["limit_fork_ms"]
    if "uss_mib" in a[0]:
        out["ours_uss_mib"], out["limit_uss_mib"] = med(a, "uss_mib"), med(b, "uss_mib")
        out["ours_pss_mib"], out["limit_pss_mib"] = med(a, "pss_mib"), med(b, "pss_mib")
        out["uss_ratio"] = out["ours_uss_mib"] / out["limit_uss_mib"]
        out["pss_ratio"] = out["ours_pss_mib"] / out["limit_pss_mib"]
    if "first_eval_ms" in a[0]:
        for key in ("first_eval_ms", "second_eval_ms", "first_eval_all_ms", "second_eval_all_ms"):
            out[f"ours_{key}"] = med(a, key)
    return out


def profile(ctl: Controller, n: int, memory: bool = False) -> dict:
    from fanout_profile import CHILD_PROBE, HostProbe, breakdown, print_breakdown

    tag = "fanout-profile"
    ctl.create_snapshot(tag, setup=SETUP.format(mib=64) + CHILD_PROBE.replace("{memory}", str(memory)))
    try:
        spawn_once(ctl, tag, 10)  # warm: the first spawn of a snapshot faults in what later ones share
        probe = HostProbe()
        probe.attach(ctl)
        try:
            t0 = time.monotonic()
            kids = ctl.spawn(tag, n)
            t1 = time.monotonic()
            for k in kids:
                ctl.ping(k["id"])
            t2 = time.monotonic()
        finally:
            probe.detach()
        prof = breakdown(probe, t0, t1, t2)
        for k in kids:
            ctl.kill_sandbox(k["id"])
        raw_one = raw(n)
        prof["raw"] = raw_one
        print_breakdown(prof)
        print(f"raw os.fork() of the same workload: forks {raw_one['fork_ms']:.1f} ms, all answered "
              f"{raw_one['total_ms']:.1f} ms")
        return prof
    finally:
        ctl.delete_snapshot(tag)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="store_true", help="only the stage breakdown of one spawn(n=100)")
    parser.add_argument("--profile-memory", action="store_true",
                        help="with --profile: each child's private memory after each stage (slower stages)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["spawn_n100", "spawn_n500", "demo_fork10", "notebook_fork5", "vm_restore"],
                        action="append", help="measure only these figures (repeatable)")
    parser.add_argument("--no-notebook", action="store_true", help="leave out %%forkd fork -n 5 (a forkd serve "
                                                                   "and a kernel)")
    parser.add_argument("--no-vm", action="store_true", help="leave out the VM restore (a QEMU snapshot)")
    args = parser.parse_args()
    # whether a move into a cgroup waits for an RCU grace period here (`forkd doctor`'s row)
    out: dict = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release,
                             "cgroup_moves": check_cgroup_moves()["detail"]},
                 "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="fkf") as data_dir:
        ctl = Controller(data_dir)
        try:
            if args.profile:
                out["profile"] = profile(ctl, 100, args.profile_memory)
            elif not args.only or set(args.only) - {"notebook_fork5", "vm_restore"}:
                ctl.create_snapshot("fanout64", setup=SETUP.format(mib=64))
                ctl.create_snapshot("fanout200", setup=SETUP.format(mib=200))
                spawn_once(ctl, "fanout64", 10)  # warm
                figures = {
                    "spawn_n100": lambda: paired("spawn n=100", args.rounds, lambda: spawn_once(
                        ctl, "fanout64", 100, memory=True, first_eval=True), lambda: raw(100)),
                    "spawn_n500": lambda: paired("spawn n=500", max(1, args.rounds // 2), lambda: spawn_once(
                        ctl, "fanout64", 500), lambda: raw(500)),
                    "demo_fork10": lambda: paired("demo fork 10", args.rounds, lambda: spawn_once(
                        ctl, "fanout200", 10), lambda: raw(10, 200))}
                for name, measure in figures.items():
                    if not args.only or name in args.only:
                        out[name] = measure()
                for tag in ("fanout64", "fanout200"):
                    ctl.delete_snapshot(tag)
        finally:
            ctl.close()
    if not args.profile and not args.no_vm and (not args.only or "vm_restore" in args.only) \
            and shutil.which("qemu-system-x86_64"):
        from vm_restore import vm_restore
        out["vm_restore"] = vm_restore(args.rounds)
    if not args.profile and not args.no_notebook and (not args.only or "notebook_fork5" in args.only):
        from fanout_notebook import notebook_fork5
        out["notebook_fork5"] = notebook_fork5(args.rounds)
    out["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(out, indent=1))
    elif not args.profile:
        for key, value in out.items():
            print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
