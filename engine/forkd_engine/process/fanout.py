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
_error = None  # its forkd_fanout_error
_handover = None  # its forkd_fanout_handover
IDLE_CONNS = 64  # as fanout.c


class _Setup(ctypes.Structure):
    """What each agent sets up in C before Python resumes (``struct setup`` in fanout.c)."""
    _fields_ = [("ns_flags", ctypes.c_int), ("close_fds", ctypes.POINTER(ctypes.c_int)), ("n_close", ctypes.c_int),
                ("report_fd", ctypes.c_int), ("listen_fds", ctypes.POINTER(ctypes.c_int)),
                ("hostnames", ctypes.POINTER(ctypes.c_char_p)), ("ready_lines", ctypes.POINTER(ctypes.c_char_p)),
                ("ping_formats", ctypes.POINTER(ctypes.c_char_p))]


def build() -> str:
    """The path of the library built from this version of ``fanout.c`` (built now if missing)."""
    return sandbox_init.build_cached(SOURCE, NAME, "its templates' fork loop (a few lines of C)",
                                     [["-shared", "-fPIC"]], suffix=".so")


def load(path: str) -> None:
    """Load the library into this process (the bootstrap, before it enters the sandbox root)."""
    global _loop, _error, _handover
    lib = ctypes.PyDLL(path)
    fn = lib.forkd_fanout
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                   ctypes.POINTER(_Setup), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    _loop = fn
    _error = lib.forkd_fanout_error
    _error.restype = ctypes.c_char_p
    _error.argtypes = []
    _handover = lib.forkd_fanout_handover
    _handover.restype = ctypes.c_int
    _handover.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.POINTER(ctypes.c_double)]


def loaded() -> bool:
    return _loop is not None


def _hook(name: str) -> int:
    return ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value


def fork_children(n: int, pidns_fd: int, init: str, agents: Agents | None = None) -> tuple[int, list[int]]:
    """Fork ``n`` children, each PID 1 of a new pid namespace, where it forks the agent and execs
    ``init`` (forkd-init); with ``agents``, each agent sets itself up so before Python resumes in
    it (``set_up_error`` then says whether it could). Returns (its index counted from 1, []) in an
    agent, and (0, the pids of the inits) in the template; OSError with the errno of the call that
    failed (the children made before it run on)."""
    pids = (ctypes.c_int * n)()
    setup = agents.struct(n) if agents is not None else None
    got = _loop(n, pidns_fd, pids, init.encode(), ctypes.byref(setup) if setup is not None else None,
                _hook("PyOS_BeforeFork"), _hook("PyOS_AfterFork_Parent"), _hook("PyOS_AfterFork_Child"))
    if got > 0:
        return got, []
    if got < 0:
        raise OSError(-got, os.strerror(-got), init if -got in (errno.ENOENT, errno.EACCES) else None)
    return 0, list(pids)


class Agents:
    """How a spawn's agents set themselves up in the C loop: close the template's agent
    descriptors ``close_fds`` but the spawn's ``report_fd`` and each one's own listener
    (``listen_fds``, by index), take new namespaces (``ns_flags``, for unshare), mount their
    /proc, set their ``hostnames`` and, in a new network namespace, bring lo up. With
    ``ready_lines`` and ``ping_formats`` (by index), each then reports ready and idles in C,
    answering pings, until its first other request (``handover``)."""

    def __init__(self, ns_flags: int, close_fds: set[int], report_fd: int, listen_fds: list[int],
                 hostnames: list[str], ready_lines: list[bytes] | None = None,
                 ping_formats: list[bytes] | None = None):
        self.ns_flags, self.close_fds, self.report_fd = ns_flags, sorted(close_fds), report_fd
        self.listen_fds, self.hostnames = list(listen_fds), [h.encode()[:64] for h in hostnames]
        self.ready_lines, self.ping_formats = ready_lines, ping_formats
        self._keep: list = []  # the C arrays, alive until the loop is done

    def struct(self, n: int) -> _Setup:
        if len(self.listen_fds) != n or len(self.hostnames) != n:
            raise ValueError(f"{n} children need {n} listeners and hostnames")
        idling = self.ready_lines is not None
        if idling and (len(self.ready_lines) != n or len(self.ping_formats or ()) != n):
            raise ValueError(f"{n} idling children need {n} ready lines and ping formats")
        close = (ctypes.c_int * len(self.close_fds))(*self.close_fds)
        listen = (ctypes.c_int * n)(*self.listen_fds)
        names = (ctypes.c_char_p * n)(*self.hostnames)
        ready = (ctypes.c_char_p * n)(*self.ready_lines) if idling else None
        pings = (ctypes.c_char_p * n)(*self.ping_formats) if idling else None
        self._keep = [close, listen, names, ready, pings]
        return _Setup(self.ns_flags, close, len(self.close_fds), self.report_fd, listen, names, ready, pings)


def set_up_error() -> str | None:
    """In an agent forked with ``Agents``: what of its set-up failed, or None."""
    err = _error()
    return err.decode(errors="replace") if err else None


def handover() -> tuple[list[int], float] | None:
    """In an agent forked with ``Agents`` that idled in C: the connections it accepted meanwhile
    (to serve on, a request perhaps waiting unread in one) and when it was forked (as
    ``time.time()``); None when it did not idle (it has not reported ready)."""
    fds = (ctypes.c_int * IDLE_CONNS)()
    at = ctypes.c_double()
    n = _handover(fds, IDLE_CONNS, ctypes.byref(at))
    return None if n < 0 else (list(fds[:n]), at.value)
