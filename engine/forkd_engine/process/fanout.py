"""The template's fork of a spawn's children, in one C loop (``fanout.c``).

Built like forkd-init (``sandbox_init.py``), with the host's C compiler, once per version of the
source, into forkd's cache; the bootstrap loads it while it still sees the host's files (before it
enters the sandbox root), so every template, and every branch (a fork of a sandbox of one), has it
mapped. Without it (a process started otherwise) the template forks in a Python loop instead.
"""

from __future__ import annotations

import ctypes
import errno
import os

from . import sandbox_init

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fanout.c")
NAME = "forkd-fanout"

_loop = None  # forkd_fanout of the loaded library, in a template


def build() -> str:
    """The path of the library built from this version of ``fanout.c`` (built now if missing)."""
    return sandbox_init.build_cached(SOURCE, NAME, "its templates' fork loop (a few lines of C)",
                                     [["-shared", "-fPIC"]], suffix=".so")


def load(path: str) -> None:
    """Load the library into this process (the bootstrap, before it enters the sandbox root)."""
    global _loop
    fn = ctypes.PyDLL(path).forkd_fanout
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    _loop = fn


def loaded() -> bool:
    return _loop is not None


def _hook(name: str) -> int:
    return ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value


def fork_children(n: int, pidns_fd: int, init: str) -> tuple[int, list[int]]:
    """Fork ``n`` children, each PID 1 of a new pid namespace, where it forks the agent and execs
    ``init`` (forkd-init). Returns (its index counted from 1, []) in an agent, and (0, the pids of
    the inits) in the template; OSError with the errno of the call that failed (the children made
    before it run on)."""
    pids = (ctypes.c_int * n)()
    got = _loop(n, pidns_fd, pids, init.encode(), _hook("PyOS_BeforeFork"), _hook("PyOS_AfterFork_Parent"),
                _hook("PyOS_AfterFork_Child"))
    if got > 0:
        return got, []
    if got < 0:
        raise OSError(-got, os.strerror(-got), init if -got in (errno.ENOENT, errno.EACCES) else None)
    return 0, list(pids)
