"""What a sandbox's agent does with signals, read from /proc: for the message of a test about
interrupts, so a failure says where the SIGINT went (pending, blocked, ignored, which thread);
a signal for its main thread, sent until it has acted; and whether a stop has reached every thread."""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable


def _fields(path: str, names: tuple[str, ...]) -> str:
    try:
        with open(path) as f:
            lines = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError as exc:
        return f"({exc.strerror})"
    return " ".join(f"{name}={lines.get(name, '?').strip()}" for name in names)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"({exc.strerror})"


def signal_report(pid: int | None) -> str:
    """Each thread of ``pid``: its name, the syscall it is in, and its signal masks (hex, bit n-1
    is signal n; SIGINT is bit 1)."""
    if not pid:
        return "no pid to look at"
    lines = [f"agent {pid}: " + _fields(f"/proc/{pid}/status", ("State", "ShdPnd", "SigIgn", "SigCgt"))]
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError as exc:
        return f"agent {pid}: gone ({exc.strerror})"
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        lines.append(f"  thread {tid} {_read(task + '/comm')!r}: syscall [{_read(task + '/syscall')}] "
                     + _fields(task + "/status", ("State", "SigPnd", "SigBlk")))
    return "\n".join(lines)


def signal_main_thread_until(pid: int, sig: int, done: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Send ``sig`` to the main thread of ``pid`` (tgkill: its tid is its pid, and no other thread
    can take the signal), again every 0.1 s until ``done()``. Once is not enough: a signal that
    lands just before the thread blocks waiting for its next job wakes nothing, and Python runs a
    handler only on the main thread (the agent's interrupt insists for the same reason). For a
    handler a test's cell installed, signalled once the cell is answered: a thread set to act on a
    timer instead may act before the answer is sent on a loaded host."""
    tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}\n{signal_report(pid)}"
        tgkill(pid, pid, sig)
        time.sleep(0.1)


def stopped(pid: int) -> bool:
    """Every thread of process ``pid`` stopped (SIGSTOP): a stop takes each thread in turn, and one
    not yet reached may still answer a request."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return all(state in ("T", "t") for state in states)
