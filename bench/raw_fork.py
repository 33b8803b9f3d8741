"""The physical limit of a fan-out: ``os.fork()`` of the same workload, children answering a ping.

    python3 bench/raw_fork.py N [MIB] [--ipython]     # prints one JSON object

The process holds what a bench snapshot holds (numpy, its random module, an array of MIB MiB, the
heap frozen as a template freezes it; with ``--ipython`` also an IPython shell, as a notebook's
sandbox holds), forks N children in a loop, each with one end of a socket
pair, then pings every child and waits for every answer. Figures: ``fork_ms`` (the loop),
``total_ms`` (until the last answer), ``cpu_ms`` (the CPU time all of it took: the parent's
from the first fork on and each child's, from schedstat), and the median USS and PSS of an idle child
(``smaps_rollup``), read while the children wait for the next message.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import socket
import statistics
import sys
import time


def rollup(pid: int) -> dict:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        out = {}
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
        return out


def own_cpu_ns() -> int:
    """CPU time of this process so far, its ended threads included (getrusage)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return int((usage.ru_utime + usage.ru_stime) * 1e9)


def cpu_ns(pid: int | str = "self") -> int:
    """CPU time of the live threads of a process so far (schedstat, ns; threads that have ended are
    not counted): robust to a loaded machine, where wall time mostly says how long others ran."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0])
    mib = int(args[1]) if len(args) > 1 else 64
    if "--ipython" in sys.argv:
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()  # noqa: F841 - the workload
    import numpy
    import numpy.random  # noqa: F401 - as a template prewarms it
    data = numpy.ones(mib * 2**20 // 8)  # noqa: F841 - the workload
    gc.collect()
    gc.freeze()
    socks, pids = [], []
    cpu0 = own_cpu_ns()
    t0 = time.perf_counter()
    for _ in range(n):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            for s in socks:
                s.close()
            while theirs.recv(16) == b"ping":
                theirs.send(b"pong")
            os._exit(0)
        theirs.close()
        socks.append(ours)
        pids.append(pid)
    forked = time.perf_counter()
    for s in socks:
        s.send(b"ping")
    for s in socks:
        if s.recv(16) != b"pong":
            raise SystemExit("a child did not answer")
    answered = time.perf_counter()
    cpu = own_cpu_ns() - cpu0 + sum(cpu_ns(pid) for pid in pids)
    mem = [rollup(pid) for pid in pids]
    for s in socks:
        s.close()
    for pid in pids:
        os.waitpid(pid, 0)
    print(json.dumps({
        "n": n, "fork_ms": (forked - t0) * 1000, "total_ms": (answered - t0) * 1000, "cpu_ms": cpu / 1e6,
        "uss_mib": statistics.median(m["Private_Clean"] + m["Private_Dirty"] for m in mem) / 1024,
        "pss_mib": statistics.median(m["Pss"] for m in mem) / 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
