"""Child processes of an agent: reap its own and orphans, never a status someone waits for.

The agent forks templates and sandboxes for spawns and branches (process engine), and is PID 1 of
its guest (VM engine), where every orphan becomes its child: those must be reaped, or zombies pile
up. (In a process sandbox PID 1 is forkd-init, which reaps the orphans.) But the user's code runs in
the agent process too, so the processes *it* starts (``subprocess``, ``os.fork``, ``multiprocessing``,
``os.posix_spawn``...) are also the agent's children, and their exit statuses belong to the user:
reaping one of those would make ``Popen.poll()`` report 0 for a process that exited 3.

So every way Python starts a process is wrapped to record the new pid under a lock, and the reaper
(a thread of its own, or one the agent has anyway, woken by SIGCHLD through a pipe, never blocking
in the signal handler) reaps only zombies that nobody recorded: orphans, and processes the agent
itself forked. The one gap is C code that calls ``fork()`` directly, bypassing Python; its
children are reaped like orphans.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import threading
from typing import Callable

import _posixsubprocess

_lock = threading.Lock()          # held while a user process is created and while the reaper decides
_user_children: set[int] = set()  # pids user code started and may still wait for
_raw_fork = os.fork               # the agent's own forks (spawn, branch) use this: they are reaped
_installed = False
_wake_r = _wake_w = -1


def _recorded(start: Callable, pid_of: Callable = lambda r: r) -> Callable:
    def wrapper(*args, **kwargs):
        with _lock:
            result = start(*args, **kwargs)
            pid = pid_of(result)
            if pid:  # 0 in a forked child (which never returns through here in the parent's role)
                _user_children.add(pid)
        return result

    wrapper.__wrapped__ = start
    wrapper.__name__ = getattr(start, "__name__", "start")
    wrapper.__doc__ = getattr(start, "__doc__", None)
    return wrapper


def _after_fork_in_child() -> None:
    """A fork has none of its parent's children, and the lock may have been held by another thread."""
    global _lock
    _lock = threading.Lock()
    _user_children.clear()


def install(reaper_thread: bool = True) -> None:
    """Record every process user code starts; start the orphan reaper (see ``start_reaper``). Call
    on the main thread."""
    global _installed
    if not _installed:
        _installed = True
        os.fork = _recorded(os.fork)
        if hasattr(os, "forkpty"):
            os.forkpty = _recorded(os.forkpty, lambda r: r[0])
        for name in ("posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                setattr(os, name, _recorded(getattr(os, name)))
        # subprocess and multiprocessing start processes through _posixsubprocess.fork_exec;
        # subprocess keeps a module-level alias of it.
        _posixsubprocess.fork_exec = _recorded(_posixsubprocess.fork_exec)
        if hasattr(subprocess, "_fork_exec"):
            subprocess._fork_exec = _posixsubprocess.fork_exec
        os.register_at_fork(after_in_child=_after_fork_in_child)
    start_reaper(reaper_thread)


def start_reaper(thread: bool = True) -> None:
    """(Re)start the reaper: after a fork the child has none, so it calls this again (the fork
    closed its copy of the old wake-up pipe with the rest of the agent's descriptors). With
    ``thread``, a thread of its own waits for the wake-ups; else a thread the caller already has
    waits on ``wake_fd()`` and calls ``tend()`` (a sandbox's accepting thread: one thread, its
    stack and its memory, fewer per sandbox)."""
    global _wake_r, _wake_w
    _wake_r, _wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, _on_sigchld)
    if thread:
        threading.Thread(target=_reap_forever, args=(_wake_r,), name="forkd-reaper", daemon=True).start()


TEND_EVERY = 2.0  # s between reaper passes without a wake-up: covers one lost while the handler was deferred


def wake_fd() -> int:
    """The read end of the reaper's wake-up pipe (readable after a SIGCHLD)."""
    return _wake_r


def tend() -> None:
    """One pass of the reaper for a thread that also does other work (it waits on ``wake_fd()``
    with a timeout of ``TEND_EVERY``): take the wake-ups, reap what ended. Never waits for the
    process-creation lock: held elsewhere, the pass is left to the next wake-up or timeout."""
    with contextlib.suppress(BlockingIOError):
        os.read(_wake_r, 4096)
    if _user_children or _any_exited():
        reap_orphans(wait=False)


def agent_fds() -> set[int]:
    """Descriptors this module holds (the agent's, not the user's)."""
    return {fd for fd in (_wake_r, _wake_w) if fd >= 0}


def forget_fds() -> None:
    """In a fork, after the agent's descriptors were closed: their numbers are no longer ours."""
    global _wake_r, _wake_w
    _wake_r = _wake_w = -1


def _on_sigchld(_signum, _frame) -> None:
    # Only a write to a non-blocking pipe: a signal handler must never block or take a lock.
    with contextlib.suppress(OSError):
        os.write(_wake_w, b"c")


def _reap_forever(wake_fd: int) -> None:
    poller = select.poll()
    poller.register(wake_fd, select.POLLIN)
    while True:
        try:
            # Woken by SIGCHLD; the timeout covers a wake-up lost while the handler was deferred.
            if poller.poll(TEND_EVERY * 1000):
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_fd, 4096)
            if _user_children or _any_exited():
                reap_orphans()
        except OSError as exc:
            if exc.errno == errno.EBADF:  # replaced by a fresh pipe (a fork restarted the reaper)
                return
        except Exception:  # noqa: BLE001 - the reaper must outlive any surprise
            pass


def _any_exited() -> bool:
    """Whether any child has exited and waits to be reaped (a peek: none is reaped). An idle agent's
    wake-up is then one system call, not a walk of /proc: with hundreds of idle sandboxes, each
    waking every 2 s, that walk cost CPU, and each sandbox private memory for the file reading."""
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False


def _zombie_children() -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] == b"Z" and int(fields[1]) == me:
            found.append(int(name))
    return found


def reap_orphans(wait: bool = True) -> list[int]:
    """Reap every exited child that user code did not start; returns their pids. Without ``wait``,
    nothing is done while another thread holds the process-creation lock."""
    reaped, lock = [], _lock
    if not lock.acquire(blocking=wait):
        return reaped
    try:
        for pid in _zombie_children():
            if pid in _user_children:
                continue
            with contextlib.suppress(ChildProcessError):
                got, _ = os.waitpid(pid, os.WNOHANG)
                if got:
                    reaped.append(pid)
        # A recorded pid that is no longer our child was waited for by its owner: forget it, so a
        # later orphan that reuses the number is not skipped.
        for pid in list(_user_children):
            if not _is_child(pid):
                _user_children.discard(pid)
    finally:
        lock.release()
    return reaped


def _is_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return int(stat[stat.rindex(b")") + 2:].split()[1]) == os.getpid()


def user_children() -> set[int]:
    """Pids user code started that are still our children (alive, or exited and not yet waited)."""
    with _lock:
        return {pid for pid in _user_children if _is_child(pid)}


def raw_fork() -> int:
    """fork() for the agent's own purposes: the child is reaped by the agent, not left to the user."""
    return _raw_fork()
