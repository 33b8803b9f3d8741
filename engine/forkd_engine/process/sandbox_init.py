"""forkd-init, the PID 1 of every process sandbox and template (``init.c``), host side.

It is built from its source with the host's C compiler, once per version of the source, into a
cache shared by every data dir (``$FORKD_CACHE_DIR``, else ``$XDG_CACHE_HOME/forkd`` or
``~/.cache/forkd``), and bound read-only into each snapshot's root as ``/forkd-init``, where the first
process of every new pid namespace execs it (``inside.py``). After the sandbox's agent has ended,
its command name says how (``forkd-init s9``), until the engine collects that (``SIGTERM``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess

from .. import linux
from ..base import ExitStatus

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init.c")
IN_SANDBOX = "/forkd-init"
NAME = "forkd-init"


class InitUnavailable(RuntimeError):
    pass


def cache_dir() -> str:
    return os.environ.get("FORKD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "forkd")


def build() -> str:
    """The path of forkd-init built from this version of ``init.c`` (built now if missing)."""
    # Static where the C library allows it: the fewest private pages in each of many processes.
    return build_cached(SOURCE, NAME, "its sandboxes' init (forkd-init, a few lines of C)", [["-static"], []])


def build_cached(source_path: str, name: str, what: str, variants: list[list[str]], suffix: str = "") -> str:
    """``source_path`` built with the host's C compiler into forkd's cache, once per version of the
    source (the first of ``variants``, extra compiler flags, that builds); returns its path."""
    with open(source_path, "rb") as f:
        source = f.read()
    out = os.path.join(cache_dir(), f"{name}-{hashlib.sha256(source).hexdigest()[:16]}{suffix}")
    if os.access(out, os.X_OK):
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise InitUnavailable(f"the process engine builds {what} with the host's C compiler, and there is "
                              f"none: apt-get install gcc libc6-dev")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = f"{out}.{os.getpid()}.partial"
    for flags in variants:
        done = subprocess.run([cc, "-Os", "-s", *flags, "-o", partial, source_path], capture_output=True, text=True)
        if done.returncode == 0:
            break
    else:
        raise InitUnavailable(f"could not build {name} with {cc} (apt-get install gcc libc6-dev): "
                              f"{done.stderr.strip()[-800:]}")
    os.chmod(partial, 0o755)
    os.replace(partial, out)  # another engine may build the same at once: either copy is the same
    return out


_ENDED = re.compile(r"^forkd-init ([sx])(\d+)$")


def ending(pid: int, start_time: int | None) -> ExitStatus | None:
    """How the agent under init ``pid`` ended, as that init says; None while it runs, or if the
    init is gone (or ``pid`` names another process now)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return None
    if linux.process_start_time(pid) != start_time:
        return None
    m = _ENDED.match(comm)
    if m is None:
        return None
    return ExitStatus(signal=int(m.group(2))) if m.group(1) == "s" else ExitStatus(code=int(m.group(2)))


def _depth(pid: int) -> int:
    """How many pid namespaces ``pid`` is in (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((len(line.split()) - 1 for line in f if line.startswith("NSpid:")), 0)
    except OSError:
        return 0


def holds_forks(pid: int) -> bool:
    """Whether init ``pid`` holds forks of its agent (a child in a namespace nested in its own),
    which it outlives the agent for; its other children are the agent and its strays."""
    own = _depth(pid)
    return any(_depth(child) > own for child in linux.live_children(pid))


def collect(pid: int, start_time: int | None) -> None:
    """Tell init ``pid`` that its agent's end is known: it exits once nothing nested in it lives."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if linux.process_start_time(pid) == start_time:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    finally:
        os.close(pidfd)
