"""What this host can still take: the ``capacity`` block of ``/healthz``, which a router placing
work across hosts reads on every heartbeat, so every figure is a few file reads or a count of the
registry's cached rows (no engine, no sandbox is asked).

- ``memory_free``: bytes left for sandboxes, the smaller of the kernel's ``MemAvailable`` and, for
  each engine, what the memory limits over its cgroup leaves (the data dir's group and its
  ancestors, a container's own group included) still allow.
- ``sandboxes``: sandboxes held, started or starting; ``max_sandboxes``: the cap (``forkd serve
  --max-sandboxes``, ``ForkdApp.max_sandboxes``), null for none.
- ``snapshots``: ready snapshots held; ``load``: the 1-minute load average.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .controller import Controller


def mem_available(path: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_free(engines: dict) -> int | None:
    figures = [mem_available()]
    for engine in engines.values():
        cgroups = getattr(engine, "cgroups", None)
        if cgroups is not None:
            figures.append(cgroups.memory_room())
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def capacity(ctl: "Controller") -> dict:
    return {
        "memory_free": memory_free(ctl.engines),
        "sandboxes": ctl.sandboxes.held(),
        "max_sandboxes": ctl.max_sandboxes,
        "snapshots": ctl.registry.count_snapshots("ready"),
        "load": os.getloadavg()[0],
    }
