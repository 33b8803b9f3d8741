"""A VM restore to a confirmed agent against a bare QEMU restore of the same snapshot, in one run.

    python3 bench/vm_restore.py [--rounds 10] [--json]     # alone
    python3 bench/fanout.py --only vm_restore              # as fan-out's ``vm_restore`` figure

One 256 MiB snapshot (TCG here), then ``--rounds`` interleaved pairs (which goes first alternates):

- the limit: QEMU started with the engine's own command line (``Qemu.launch``: the same binary,
  machine, devices, RAM file mapped privately, ``-incoming fd:`` on the snapshot's device state),
  timed until QEMU's monitor reports the migration completed. ``qmp_ms`` is the start until the
  monitor's greeting (QEMU loads an ``-incoming fd:`` stream before its main loop runs, so the
  greeting comes after most of the load).
- ours: ``VMEngine.spawn`` of one child until its agent confirmed the restore (entropy, clock,
  RNG reseed, identity), the same as every spawn.

CPU: QEMU's own (every thread, schedstat) when it is done, and the bench process's (getrusage:
the engine's host-side work, its agent channel included) for ours. The split of ours comes from the
engine's ``restore_trace`` marks, per round: ``host_ms`` (the engine's own work on the critical
path, outside QEMU's steps), ``start_load_ms`` (QEMU started and its device state loaded, on the
critical path only when no pre-started QEMU was ready; a cold restore does it in one step with the
guest's run, so it is taken as the paired bare restore's), ``resume_to_reply_ms`` (the guest let
run until the agent's reply: under TCG mostly translating the guest's post-restore path afresh)
and the CPU of that last stage (``guest_cpu_ms``). A ratio of medians is the figure; on a loaded machine the CPU ratio is
the steadier one. ``pre_started``: what the QEMUs the engine keeps waiting cost (memory each,
their CPU while they wait).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engine"))

from forkd_engine import ChildSpec, SnapshotSpec, linux  # noqa: E402
from forkd_engine.vm import VMEngine  # noqa: E402
from forkd_engine.vm.qmp import QMP  # noqa: E402

SETUP = "import os, time, random\nstate = {'ready': True}\n"


def qemu_cpu_ms(pid: int) -> float:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e6


def own_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * 1000


def bare(engine: VMEngine, snap: dict, name: str) -> dict:
    """QEMU with the engine's command line on the snapshot, until its monitor says loaded."""
    t0 = time.perf_counter()
    h = engine.qemu.launch(name, snap["image"], snap["memory"], snap["mem_mib"], share=False,
                           incoming_file=snap["devices"], packages=snap.get("packages_image"))
    try:
        with QMP(h["qmp"]) as qmp:
            t1 = time.perf_counter()
            while qmp.execute("query-migrate").get("status") != "completed":
                pass
            t2 = time.perf_counter()
        cpu = qemu_cpu_ms(h["pid"])
    finally:
        engine.qemu.stop(h["pid"], h["start_time"])
        shutil.rmtree(h["dir"], ignore_errors=True)
    return {"total_ms": (t2 - t0) * 1000, "qmp_ms": (t1 - t0) * 1000, "cpu_ms": cpu}


def ours(engine: VMEngine, snap: dict, name: str) -> dict:
    engine.restore_trace = []
    host0, t0 = own_cpu_ms(), time.perf_counter()
    (h,) = engine.spawn(snap, [ChildSpec(id=name)])
    t1, host1 = time.perf_counter(), own_cpu_ms()
    qemu = qemu_cpu_ms(h["pid"])
    (marks,) = engine.restore_trace
    engine.restore_trace = None
    engine.kill(h)
    total = (t1 - t0) * 1000
    row = {"total_ms": total, "cpu_ms": qemu + host1 - host0, "qemu_cpu_ms": qemu, "host_cpu_ms": host1 - host0,
           "warm": bool(marks.get("warm"))}
    if row["warm"]:  # started and loaded ahead, while nobody waited: only the resume is on the path
        row.update(start_load_ms=0.0, resume_to_reply_ms=(marks["replied"] - marks["resumed"]) * 1000,
                   guest_cpu_ms=qemu - marks["cpu_before_resume_ms"])
    else:  # one step from QEMU's start to the reply: see split_cold
        row["qemu_ms"] = (marks["replied"] - marks["launched"]) * 1000
    row["host_ms"] = total - (marks["replied"] - marks["launched"]) * 1000 \
        if not row["warm"] else total - row["resume_to_reply_ms"]
    return row


def split_cold(row: dict, limit: dict) -> None:
    """A restore with no pre-started QEMU runs start, load and guest in one step: its start and load
    are taken as the paired bare restore's (the same command line, the same work)."""
    if row["warm"]:
        return
    row["start_load_ms"] = limit["total_ms"]
    row["resume_to_reply_ms"] = row["qemu_ms"] - limit["total_ms"]
    row["guest_cpu_ms"] = row["qemu_cpu_ms"] - limit["cpu_ms"]


def pooled_cost(engine: VMEngine, snap: dict) -> dict:
    """What the QEMUs waiting for the next children cost: memory (smaps_rollup) and CPU over 1 s."""
    engine.warm.wait_filled(snap, 60)
    with engine.warm.lock:
        pids = [w.handle["pid"] for w in engine.warm.ready]
    if not pids:
        return {"count": 0}
    mems = [linux.smaps_memory(pid) for pid in pids]
    cpu0 = sum(qemu_cpu_ms(pid) for pid in pids)
    time.sleep(1.0)  # the span the idle CPU is measured over
    return {"count": len(pids), "pss_mib_each": round(statistics.median(m["pss_kib"] for m in mems) / 1024, 1),
            "uss_mib_each": round(statistics.median(m["uss_kib"] for m in mems) / 1024, 1),
            "idle_cpu_ms_per_s": round(sum(qemu_cpu_ms(pid) for pid in pids) - cpu0, 2)}


def vm_restore(rounds: int, data_dir: str | None = None, log=None) -> dict:
    """The ``vm_restore`` figure: ``rounds`` interleaved pairs, medians and their ratios."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    root = tempfile.mkdtemp(prefix="fkvr", dir=data_dir)
    engine = VMEngine(os.path.join(root, "vm"), cache_dir=os.environ.get("FORKD_VM_CACHE"))
    engine.warm_up()  # as a server does once it listens: no branch pause pays numpy's import
    try:
        snap = engine.create_snapshot(SnapshotSpec(tag="restore", setup=SETUP, mem_size_mib=256))
        # The first restore faults the snapshot's files into the page cache; from the second spawn
        # of a snapshot on, the engine keeps QEMUs started ahead for it (vm/warm.py).
        for name in ("warm-up-1", "warm-up-2"):
            ours(engine, snap, name)
        a, b = [], []
        for i in range(rounds):
            # Steady state: the QEMUs the engine pre-starts after a spawn are ready again (their
            # CPU is in ours: all of each QEMU's, its start and load included).
            engine.warm.wait_filled(snap, 60)
            pair = [lambda: a.append(ours(engine, snap, f"c{i}")), lambda: b.append(bare(engine, snap, f"b{i}"))]
            for run in (pair if i % 2 == 0 else pair[::-1]):
                run()
            split_cold(a[-1], b[-1])
            log(f"  vm restore round {i + 1}/{rounds}: ours {a[-1]['total_ms']:.1f} ms "
                f"({a[-1]['cpu_ms']:.0f} ms CPU{', pre-started' if a[-1]['warm'] else ''}; guest run to the reply "
                f"{a[-1]['resume_to_reply_ms']:.1f} ms, {a[-1]['guest_cpu_ms']:.0f} ms CPU), "
                f"bare QEMU {b[-1]['total_ms']:.1f} ms ({b[-1]['cpu_ms']:.0f} ms CPU)")
        pooled = pooled_cost(engine, snap)
        engine.delete_snapshot(snap)
    finally:
        engine.close()
        shutil.rmtree(engine.mem_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    def med(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.median(values), 1) if values else None

    out = {"ours_total_ms": med(a, "total_ms"), "limit_total_ms": med(b, "total_ms"),
           "ours_runs_ms": [round(r["total_ms"], 1) for r in a], "limit_runs_ms": [round(r["total_ms"], 1) for r in b],
           "ours_cpu_ms": med(a, "cpu_ms"), "limit_cpu_ms": med(b, "cpu_ms"),
           "limit_qmp_ms": med(b, "qmp_ms"), "ours_pre_started": sum(r["warm"] for r in a),
           "ours_split_ms": {k: med(a, k) for k in ("host_ms", "start_load_ms", "resume_to_reply_ms")},
           "ours_cpu_split_ms": {k: med(a, k) for k in ("host_cpu_ms", "qemu_cpu_ms", "guest_cpu_ms")},
           "pre_started": pooled}
    out["ratio"] = round(out["ours_total_ms"] / out["limit_total_ms"], 2)
    out["cpu_ratio"] = round(out["ours_cpu_ms"] / out["limit_cpu_ms"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = {"load_before": os.getloadavg()}
    out["vm_restore"] = vm_restore(args.rounds)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
