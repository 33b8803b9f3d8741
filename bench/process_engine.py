"""Benchmark of the process engine through the controller (real sandboxes, this machine).

    python3 bench/process_engine.py            # a table
    python3 bench/process_engine.py --json     # one JSON object

Figures:
- branch_pause_ms_p50/_p90 per mode (full, live) for sources of 256 MiB and 1.5 GiB resident: the
  time the source is frozen in fork(), as measured inside it, right after the source rewrote its
  whole array, in two states of its memory:
  - ``_split``: the array in 4 KiB pages (the worst case: memory written since the sandbox last
    idled, before its compactor moved it into huge pages);
  - ``_idle``: after the sandbox idled long enough for its compactor to move the array into huge
    pages (the notebook's case: a branch between cells), then rewrote it.
  branch_prepare_ms is the work done before the freeze while the source runs, and branch_call_ms
  the whole branch call until the new snapshot is ready.
- spawn_ms_per_child / spawn_total_ms for n = 1, 10, 100: from the spawn call until every child has
  answered a ping.
- uss_mib_per_idle_child (Private_Clean + Private_Dirty from smaps_rollup, of the agent and its init)
  and pss_mib_per_idle_child, medians over idle children at n = 10 and n = 100.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from forkd_server.controller import Controller  # noqa: E402

SETUP = "import numpy\ndata = numpy.ones({mib} * 2**20 // 8)\n"
# The source also looks at its own compactor, to know when the array has moved into huge pages.
SOURCE_SETUP = SETUP + "import forkd_engine.process.compactor as compactor\n"
MOVE_WAIT = 300.0  # s the array has to move into huge pages while the source idles


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _branches(ctl: Controller, source: str, tag: str, mode: str, reps: int) -> dict:
    """``reps`` branches of ``source``, each right after it rewrote its array in place."""
    pauses, prepares, calls = [], [], []
    for i in range(reps):
        ctl.run_code(source, "data += 1.0")  # every page of the array is written just before
        t0 = time.perf_counter()
        info = ctl.branch(source, f"{tag}-{i}", mode=mode)
        calls.append((time.perf_counter() - t0) * 1000)
        pauses.append(info["pause_us"] / 1000)
        prepares.append(info.get("prepare_ms", 0.0))
        ctl.delete_snapshot(info["tag"])
    return {"p50": statistics.median(pauses), "p90": pct(pauses, 0.9),
            "prepare_p50": statistics.median(prepares), "call_p50": statistics.median(calls),
            "call_max": max(calls)}


def _moved_mib(ctl: Controller, source: str) -> float:
    return int(ctl.eval(source, "compactor.hugetlb_kib()")["result"]) / 1024


def bench_branch(ctl: Controller, mib: int, mode: str, reps: int) -> dict:
    tag = f"bench-{mode}-{mib}"
    ctl.create_snapshot(tag, setup=SOURCE_SETUP.format(mib=mib))
    source = ctl.spawn(tag, 1)[0]["id"]
    ctl.run_code(source, "data += 1.0")  # the array is the source's own now, in 4 KiB pages
    out = {"split": _branches(ctl, source, tag, mode, reps)}
    deadline = time.monotonic() + MOVE_WAIT
    while _moved_mib(ctl, source) < mib * 0.9 and time.monotonic() < deadline:
        time.sleep(0.5)  # the sandbox idles meanwhile: its compactor moves the array
    out["moved_mib"] = _moved_mib(ctl, source)
    out["idle"] = _branches(ctl, source, f"{tag}-idle", mode, reps)
    out["source_rss_mib"] = ctl.memory(source)["rss_kib"] / 1024
    ctl.kill_sandbox(source)
    ctl.delete_snapshot(tag)
    return out


def bench_spawn(ctl: Controller, n: int) -> dict:
    tag = f"bench-spawn-{n}"
    ctl.create_snapshot(tag, setup=SETUP.format(mib=64))
    t0 = time.perf_counter()
    kids = ctl.spawn(tag, n)
    for k in kids:
        ctl.ping(k["id"])
    total = (time.perf_counter() - t0) * 1000
    mem = [ctl.memory(k["id"]) for k in kids]
    for k in kids:
        ctl.kill_sandbox(k["id"])
    ctl.delete_snapshot(tag)
    return {"spawn_total_ms": total, "spawn_ms_per_child": total / n,
            "uss_mib_per_idle_child": statistics.median(m["uss_kib"] for m in mem) / 1024,
            "pss_mib_per_idle_child": statistics.median(m["pss_kib"] for m in mem) / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reps", type=int, default=10, help="branches per source size")
    parser.add_argument("--big-mib", type=int, default=1536)
    args = parser.parse_args()
    out: dict = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release}}
    with tempfile.TemporaryDirectory(prefix="fkb") as data_dir:
        ctl = Controller(data_dir)
        try:
            for mib in (256, args.big_mib):
                for mode in ("full", "live"):
                    r = bench_branch(ctl, mib, mode, args.reps)
                    for state in ("split", "idle"):
                        for key in ("p50", "p90"):
                            out[f"branch_pause_ms_{key}_{mode}_{mib}mib_{state}"] = r[state][key]
                        out[f"branch_prepare_ms_p50_{mode}_{mib}mib_{state}"] = r[state]["prepare_p50"]
                        out[f"branch_call_ms_p50_{mode}_{mib}mib_{state}"] = r[state]["call_p50"]
                    out[f"branch_moved_into_huge_pages_mib_{mode}_{mib}mib"] = r["moved_mib"]
                out[f"branch_source_rss_mib_{mib}mib"] = r["source_rss_mib"]
            for n in (1, 10, 100):
                r = bench_spawn(ctl, n)
                out[f"spawn_total_ms_n{n}"] = r["spawn_total_ms"]
                out[f"spawn_ms_per_child_n{n}"] = r["spawn_ms_per_child"]
                if n in (10, 100):
                    out[f"uss_mib_per_idle_child_n{n}"] = r["uss_mib_per_idle_child"]
                    out[f"pss_mib_per_idle_child_n{n}"] = r["pss_mib_per_idle_child"]
        finally:
            ctl.close()
    if args.json:
        print(json.dumps(out))
    else:
        width = max(map(len, out))
        for key, value in out.items():
            print(f"{key:<{width}}  {value:.3f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
