"""What the first write after a fork costs, at the kernel, with no sandbox around it (root).

    python3 bench/first_write.py              # a table
    python3 bench/first_write.py --json       # one JSON object

Each round, 1 GiB each, the cases interleaved so load falls on all alike; wall and CPU time (the
writing thread's, which on a VM includes the hypervisor backing memory it had taken back):
- memcpy: ``np.copyto`` between two resident arrays (the floor of any copy).
- rewrite: ``a += 1.0`` of a resident array in hugetlb pages, no fork.
- cow_warm: the same right after ``fork()`` (the child holds the pages, so every 2 MiB page is
  copied at its first write), the copies taken from the warm reserve the process engine keeps
  (process/reserve.py, started here as an engine starts it).
- cow_cold: the same with no reserve: each copy takes a page from the buddy allocator, after the
  process idled ``--idle`` s as a notebook between cells.
- touch_just_freed / touch_after_idle: the first write to 1 GiB of huge pages right after 1 GiB of
  them was freed, and ``--idle`` s after; ``reported_mib``: what the kernel's free page reporting
  handed to the host meanwhile (where the kernel says).
The cold cases need the host to run no other forkd engine's reserve; the bench says if one does.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

import numpy as np
from forkd_engine.process import reserve
from forkd_engine.process.hugepages import MAP_HUGETLB, MAP_NORESERVE

GIB = 1 << 30
REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def huge_array() -> tuple[np.ndarray, mmap.mmap]:
    """1 GiB of float64 in private hugetlb pages that reserve nothing (as a moved array's are),
    written once. Close the mapping only once the array is gone."""
    m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB | MAP_NORESERVE)
    a = np.frombuffer(m, dtype=np.float64)
    a.fill(1.0)
    return a, m


def add_one(a: np.ndarray) -> None:
    np.add(a, 1.0, out=a)


def timed(fn) -> dict:
    c, w = time.thread_time(), time.perf_counter()
    fn()
    return {"wall_s": round(time.perf_counter() - w, 3), "cpu_s": round(time.thread_time() - c, 3)}


def cow(a: np.ndarray) -> dict:
    """``a += 1.0`` while a child holds the pages (it waits on a pipe, then exits)."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        return timed(lambda: add_one(a))
    finally:
        os.close(w)
        os.waitpid(child, 0)


def reported_mib() -> int | None:
    try:
        with open(REPORTED) as f:
            return int(f.read()) >> 10
    except OSError:
        return None


def touch(idle_s: float) -> dict:
    """First write to 1 GiB of huge pages, ``idle_s`` after 1 GiB of them was freed."""
    a, freed = huge_array()
    del a
    freed.close()
    before = reported_mib()
    time.sleep(idle_s)
    after = reported_mib()
    m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB | MAP_NORESERVE)
    out = timed(lambda: np.frombuffer(m, dtype=np.float64).fill(1.0))
    m.close()
    if before is not None and after is not None:
        out["reported_mib"] = after - before
    return out


def other_reserve() -> bool:
    """Whether another forkd engine on this host keeps a reserve now."""
    with open(reserve.ENGINES, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def warm_reserve_ready(limit_s: float = 120) -> float:
    t0 = time.perf_counter()
    while True:
        info = reserve.meminfo()
        if info["HugePages_Free"] - info["HugePages_Rsvd"] >= GIB >> 21 or time.perf_counter() - t0 > limit_s:
            return round(time.perf_counter() - t0, 2)
        time.sleep(0.1)


def memcpy() -> dict:
    src, dst = np.ones(GIB // 8), np.ones(GIB // 8)  # both resident
    return timed(lambda: np.copyto(dst, src))


def round_once(idle_s: float, cold: bool) -> dict:
    out: dict = {"memcpy": memcpy()}
    a, m = huge_array()
    out["rewrite"] = timed(lambda: add_one(a))
    r = reserve.HugePageReserve()  # as an engine starts it
    try:
        out["reserve_ready_s"] = warm_reserve_ready()
        time.sleep(idle_s)
        out["cow_warm"] = cow(a)
    finally:
        r.close()
    if cold:
        time.sleep(idle_s)
        out["cow_cold"] = cow(a)
    a = None
    m.close()
    if cold:
        out["touch_just_freed"] = touch(0)
        out["touch_after_idle"] = touch(idle_s)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=5.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/first_write.py: the huge-page pool is root's; run it as root", file=sys.stderr)
        return 2
    cold = not other_reserve()
    if not cold:
        print("bench/first_write.py: another forkd engine keeps a warm reserve on this host, so every copy is "
              "warm: the cold cases are left out", file=sys.stderr)
    rounds = [round_once(args.idle, cold) for _ in range(args.rounds)]
    cases = [k for k in rounds[0] if isinstance(rounds[0][k], dict)]
    results = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]}, "idle_s": args.idle,
               "rounds": rounds}
    for case in cases:
        results[case] = {k: statistics.median(r[case][k] for r in rounds) for k in rounds[0][case]}
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"1 GiB, medians of {args.rounds} rounds (load {results['machine']['load']:.1f}):")
    for case in cases:
        extra = f", {results[case]['reported_mib']:.0f} MiB reported to the host" if "reported_mib" in results[case] else ""
        print(f"  {case:18s} {results[case]['wall_s']:.3f} s wall, {results[case]['cpu_s']:.3f} s CPU{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
