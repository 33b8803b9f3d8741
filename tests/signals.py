"""What a sandbox's agent does with signals, read from /proc: for the message of a test about
interrupts, so a failure says where the SIGINT went (pending, blocked, ignored, which thread)."""

from __future__ import annotations

import os


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
