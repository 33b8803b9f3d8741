"""Benchmark of the VM engine (QEMU microVMs; TCG on this project's machines), driving the engine.

    python3 bench/vm_engine.py                 # a summary
    python3 bench/vm_engine.py --json          # one JSON object
    python3 bench/vm_engine.py --mem 256,512 --dirty 0.01,0.1,0.25 --reps 3

Figures, per guest RAM size:
- boot_to_agent_ms: QEMU started until the agent in the freshly booted parent answers.
- restore_to_agent_ms_per_child: spawn of one child (QEMU start, device state load, entropy/clock
  restore confirmed by the agent), 10 in a row, min / median; restore_cpu_ms_per_child: the host
  CPU time that QEMU process used by then (all threads, schedstat), which other load on the
  machine does not change.
- fanout10_ready_ms: one spawn call of 10 children until all 10 confirmed their restore, median of
  3 calls (each listed; fanout10_cpu_ms_per_child: CPU per QEMU process by then).
- pss_mib_per_child / rss_mib_per_child / uss_mib_per_child: the 10 idle children (smaps_rollup).
- branch_pause_ms[mode][dirty]: the source's STOP → RESUME time (QEMU's event timestamps) when it has
  dirtied that fraction of its RAM since it was restored (plus what the guest itself dirtied); also
  prepare_ms (diff: the base copy while the source runs) and branch_ready_ms (call until the new
  snapshot is complete). dirty_mib is what the engine found changed (pagemap), full and diff only.
- grandchildren: 3 children of a live branch: Pss, Rss and the shared fraction (1 - USS/Rss).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

from forkd_engine import ChildSpec, SnapshotSpec  # noqa: E402
from forkd_engine.vm import VMEngine  # noqa: E402

SETUP = "import os, time, random\nstate = {'ready': True}\n"


def med(values):
    return round(statistics.median(values), 1)


def mib(kib):
    return round(kib / 1024, 1)


def run(engine, h, code, timeout=120):
    reply = engine.call(h, {"action": "run_code", "code": code}, timeout=timeout)
    if reply.get("error"):
        raise RuntimeError(reply["error"])
    return reply


def dirty(engine, h, mem_mib: int, fraction: float) -> None:
    """Make the guest write ``fraction`` of its RAM (one byte per 4 KiB page of a fresh buffer)."""
    n = int(mem_mib * fraction) << 20
    run(engine, h, f"buf = bytearray({n})\nfor i in range(0, {n}, 4096):\n    buf[i] = 1\n")


def cpu_ms(pid: int) -> float:
    """CPU time all threads of a process have used so far (schedstat: nanosecond resolution)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e6


def bench_size(engine: VMEngine, mem_mib: int, fractions: list[float], reps: int, log,
               restores: int = 10, fanouts: int = 3) -> dict:
    out: dict = {"mem_mib": mem_mib}
    tag = f"bench{mem_mib}"
    snap = engine.create_snapshot(SnapshotSpec(tag=tag, setup=SETUP, mem_size_mib=mem_mib))
    with open(os.path.join(snap["dir"], "meta.json")) as f:
        out["boot_to_agent_ms"] = json.load(f)["boot_to_agent_ms"]
    log(f"[{mem_mib} MiB] boot to agent {out['boot_to_agent_ms']} ms")
    seq = 0

    def ids(n, prefix):
        nonlocal seq
        seq += 1
        return [ChildSpec(id=f"{prefix}{mem_mib}-{seq}-{i}") for i in range(n)]

    # sequential single restores
    times, cpus = [], []
    for _ in range(restores):
        t = time.monotonic()
        (h,) = engine.spawn(snap, ids(1, "r"))
        times.append((time.monotonic() - t) * 1000)
        cpus.append(cpu_ms(h["pid"]))
        engine.kill(h)
    out["restore_to_agent_ms_per_child"] = {"min": round(min(times), 1), "median": med(times), "n": len(times)}
    # host CPU one restore costs (QEMU start + device load + the guest's first request under TCG):
    # independent of what else runs on the machine, unlike the wall-clock figures
    out["restore_cpu_ms_per_child"] = med(cpus)
    log(f"[{mem_mib} MiB] restore to agent {out['restore_to_agent_ms_per_child']} "
        f"(host CPU {out['restore_cpu_ms_per_child']} ms)")

    # fan-out of 10, repeated: one spawn call of 10 until all 10 confirmed their restore
    fan, fan_cpu = [], []
    for rep in range(fanouts):
        t = time.monotonic()
        kids = engine.spawn(snap, ids(10, "f"))
        fan.append((time.monotonic() - t) * 1000)
        fan_cpu.append(statistics.median(cpu_ms(k["pid"]) for k in kids))
        if rep == fanouts - 1:
            mems = [engine.memory(k) for k in kids]
            out["pss_mib_per_child"] = mib(statistics.median(m["pss_kib"] for m in mems))
            out["rss_mib_per_child"] = mib(statistics.median(m["rss_kib"] for m in mems))
            out["uss_mib_per_child"] = mib(statistics.median(m["uss_kib"] for m in mems))
        for k in kids:
            engine.kill(k)
    out["fanout10_ready_ms"] = med(fan)
    out["fanout10_ready_ms_runs"] = [round(x, 1) for x in fan]
    out["fanout10_cpu_ms_per_child"] = med(fan_cpu)
    log(f"[{mem_mib} MiB] fan-out 10: {out['fanout10_ready_ms_runs']} ms, Pss/child {out['pss_mib_per_child']} MiB")

    # branch pause per mode and dirty fraction
    pauses: dict = {}
    live_snap = None
    for fraction in fractions:
        for mode in ("full", "diff", "live"):
            rows = []
            for rep in range(reps):
                (src,) = engine.spawn(snap, ids(1, "s"))
                dirty(engine, src, mem_mib, fraction)
                btag = f"b{mem_mib}-{mode}-{int(fraction * 1000)}-{rep}"
                t = time.monotonic()
                res = engine.branch(src, btag, [tag, src["name"], btag], mode)
                handle = res.ready.result(600)
                ready_ms = (time.monotonic() - t) * 1000
                row = {"pause_ms": res.pause_ms, "prepare_ms": res.prepare_ms, "branch_ready_ms": round(ready_ms, 1)}
                with open(os.path.join(handle["dir"], "branch.json")) as f:
                    info = json.load(f)
                if "dirty_bytes" in info:
                    row["dirty_mib"] = round(info["dirty_bytes"] / 2**20, 1)
                    row["steps_ms"] = info.get("steps_ms")
                if "qemu_downtime_ms" in info:
                    row["qemu_downtime_ms"] = info["qemu_downtime_ms"]
                rows.append(row)
                engine.kill(src)
                if mode == "live" and live_snap is None and fraction == fractions[-1]:
                    live_snap = handle
                else:
                    engine.delete_snapshot(handle)
            entry = {"pause_ms_min": min(r["pause_ms"] for r in rows),
                     "pause_ms_median": med([r["pause_ms"] for r in rows]),
                     "prepare_ms_median": med([r["prepare_ms"] for r in rows]),
                     "branch_ready_ms_median": med([r["branch_ready_ms"] for r in rows]),
                     "runs": rows}
            if "dirty_mib" in rows[0]:
                entry["dirty_mib_median"] = med([r["dirty_mib"] for r in rows])
            pauses.setdefault(mode, {})[str(fraction)] = entry
            log(f"[{mem_mib} MiB] {mode:4} dirty {fraction:>5}: pause {entry['pause_ms_median']} ms "
                f"(min {entry['pause_ms_min']}), ready {entry['branch_ready_ms_median']} ms"
                + (f", changed {entry['dirty_mib_median']} MiB" if "dirty_mib_median" in entry else ""))
    out["branch_pause_ms"] = pauses

    # grandchildren of the live branch: sharing with their siblings
    if live_snap is not None:
        t = time.monotonic()
        grand = engine.spawn(live_snap, ids(3, "g"))
        out["grandchildren_ready_ms"] = round((time.monotonic() - t) * 1000, 1)
        for g in grand:
            run(engine, g, "x = len(buf)")
        gm = [engine.memory(g) for g in grand]
        out["grandchildren"] = {
            "pss_mib_per_child": mib(statistics.median(m["pss_kib"] for m in gm)),
            "rss_mib_per_child": mib(statistics.median(m["rss_kib"] for m in gm)),
            "uss_mib_per_child": mib(statistics.median(m["uss_kib"] for m in gm)),
            "shared_fraction": round(statistics.median(1 - m["uss_kib"] / m["rss_kib"] for m in gm), 3),
        }
        log(f"[{mem_mib} MiB] grandchildren: {out['grandchildren']}")
        for g in grand:
            engine.kill(g)
        engine.delete_snapshot(live_snap)
    engine.delete_snapshot(snap)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mem", default="256,512", help="guest RAM sizes in MiB (comma separated)")
    ap.add_argument("--dirty", default="0.01,0.1,0.25", help="fractions of RAM the source dirties")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--data-dir", help="default: a temporary directory, removed afterwards")
    ap.add_argument("--cache-dir", help="guest image cache (default: under the data dir)")
    args = ap.parse_args(argv)
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="fkvb")
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    engine = VMEngine(os.path.join(data_dir, "vm"), cache_dir=args.cache_dir)
    engine.warm_up()  # as a server does once it listens: no branch pause pays numpy's import
    try:
        t = time.monotonic()
        image = engine.image()
        result = {"engine": "vm", "accel": engine.accel, "accel_reason": engine.accel_reason,
                  "qemu": engine.qemu_version, "kernel": image.kernel_version, "cpus": os.cpu_count(),
                  "image_ready_s": round(time.monotonic() - t, 1), "loadavg_start": os.getloadavg()[0],
                  "sizes": []}
        for m in (int(x) for x in args.mem.split(",")):
            result["sizes"].append(bench_size(engine, m, [float(x) for x in args.dirty.split(",")], args.reps, log))
        result["loadavg_end"] = os.getloadavg()[0]
    finally:
        engine.close()
        if not args.data_dir:
            shutil.rmtree(engine.mem_root, ignore_errors=True)
            shutil.rmtree(data_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
