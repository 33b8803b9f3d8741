"""What noting and reseeding random generators costs (engine/forkd_engine/agent/generators.py).

    python3 bench/generators.py [--objects 1000000] [--rounds 7]

With OBJECTS small objects made since the snapshot (a sandbox's own heap: a template's is frozen,
and neither gc.get_referrers nor gc.get_objects walks frozen objects), prints medians of:
- notice() after code that made no generator that outlived it (every cell pays this);
- notice() after code that kept a default_rng() (traced once: two gc.get_referrers heap reads),
  and after one that kept a RandomState() (three);
- the alternative of finding generators with gc.get_objects() in every copy, in time and in the
  memory it makes a fork copy (it writes every object's reference count; get_referrers writes none);
- reseed() in a fork holding 10 generators made without a seed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine"))

from forkd_engine.agent import generators

generators.install()
import numpy as np  # after install, as in a sandbox


def private_dirty_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
    return 0.0


def in_fork(fn) -> float:
    """fn() in a fork; returns the number it returns."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, repr(float(fn())).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        value = float(f.read())
    os.waitpid(pid, 0)
    return value


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def dirtied_by(scan) -> float:
    before = private_dirty_mib()
    scan()
    return private_dirty_mib() - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    heap = [[i] for i in range(args.objects)]  # noqa: F841 - the heap a scan walks
    kept = [np.random.default_rng() for _ in range(10)]
    generators.notice()
    figures: dict[str, list[float]] = {k: [] for k in ("idle", "rng", "legacy", "get_objects", "dirty_referrers",
                                                     "dirty_objects", "reseed")}
    for _ in range(args.rounds):  # interleaved: each round measures everything once
        figures["idle"].append(timed(generators.notice))
        rng = np.random.default_rng()
        figures["rng"].append(timed(generators.notice))
        legacy = np.random.RandomState()
        figures["legacy"].append(timed(generators.notice))
        del rng, legacy
        generators.notice()
        figures["get_objects"].append(timed(gc.get_objects))
        figures["dirty_referrers"].append(in_fork(lambda: dirtied_by(lambda: gc.get_referrers(kept))))
        figures["dirty_objects"].append(in_fork(lambda: dirtied_by(gc.get_objects)))
        figures["reseed"].append(in_fork(lambda: timed(generators.reseed)))
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"heap: {args.objects / 1e6:g}M objects made since the snapshot; medians of {args.rounds} rounds")
    print(f"notice(), nothing new:                 {med['idle'] * 1000:8.1f} us")
    print(f"notice(), a default_rng() kept:        {med['rng']:8.1f} ms  (once per generator)")
    print(f"notice(), a RandomState() kept:        {med['legacy']:8.1f} ms")
    print(f"gc.get_objects() (per copy) instead:   {med['get_objects']:8.1f} ms")
    print(f"private memory a scan makes in a fork: get_referrers {med['dirty_referrers']:.0f} MiB, "
          f"get_objects {med['dirty_objects']:.0f} MiB")
    print(f"reseed() in a fork, 10 generators:     {med['reseed']:8.2f} ms")


if __name__ == "__main__":
    main()
