"""Where a server's start goes, stage by stage, from the process's own start until the port listens.

A restarted server must answer within seconds, whatever the previous one left behind (recovery.py
settles that behind the listening port). ``mark(stage)`` notes when each stage of the start ended,
in seconds since the kernel started this process (``/proc/self/stat``, clock ticks: 10 ms), so
the interpreter's own start counts too; once the port listens the extension logs the stages in one
line, ``forkd: listening x.xx s after the process started (stage +seconds, ...)``, and
``bench/restart.py`` reads that line for its split by stage.
"""

from __future__ import annotations

import os
import time

_marks: list[tuple[str, float]] = []


def _process_start() -> float | None:
    """This process's start, in CLOCK_BOOTTIME seconds (the clock /proc counts start times on)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, starttime
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_START = _process_start()


def since_start() -> float:
    """Seconds since this process started (since this module was imported where /proc is missing)."""
    global _START
    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    if _START is None:
        _START = now
    return now - _START


def mark(stage: str) -> None:
    """Note that ``stage`` of the start ended now (the first mark of a name counts)."""
    if not any(name == stage for name, _ in _marks):
        _marks.append((stage, since_start()))


def stages() -> list[tuple[str, float]]:
    """(stage, seconds it took) in order: each from the end of the stage before it."""
    out, before = [], 0.0
    for name, at in _marks:
        out.append((name, at - before))
        before = at
    return out


def summary() -> str:
    """One line: the time to the last mark and the stages that made it."""
    total = _marks[-1][1] if _marks else since_start()
    return f"{total:.3f} s after the process started (" + ", ".join(
        f"{name} +{took:.3f}" for name, took in stages()) + ")"
