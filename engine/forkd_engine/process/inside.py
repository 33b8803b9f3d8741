"""The process engine's side inside the sandbox: one agent process per template or sandbox.

A *template* (a snapshot) is a parked, warmed-up interpreter. ``spawn`` forks it: each child
becomes PID 1 of a fresh pid namespace, with its own mount, network, IPC and UTS namespaces and a
private copy of /tmp. A *sandbox* serves the agent protocol; ``branch`` forks it into a new template,
so the source is paused only for the ``fork()`` itself.

Nested pid namespaces die with their init, so a template or sandbox that still has live forks is
never killed outright: ``retire`` turns it into a minimal reaper (``execve``, so its memory is freed)
that lives until its last fork is gone.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import shutil
import socket
import sys
import time

from .. import linux
from ..agent.runtime import Runtime
from ..agent.server import AgentServer, install_reaper

# What a retired template or sandbox executes: kill its own user processes, keep its forks alive.
REAPER = """
import os, signal
me = os.readlink('/proc/self/ns/pid')
for name in os.listdir('/proc'):
    if name.isdigit() and name != '1':
        try:
            if os.readlink('/proc/%s/ns/pid' % name) == me:
                os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
    except InterruptedError:
        pass
"""

_PROC_FLAGS = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC


class LineageTooDeep(OSError):
    pass


def report(fd: int, message: dict) -> None:
    """Tell the engine how a start went. The kernel attaches our pid as the engine sees it."""
    with socket.socket(fileno=os.dup(fd)) as s:
        s.send(json.dumps(message).encode())


def close_fds_except(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep | {-1}):
        if fd > low:
            os.closerange(low, fd)
        low = max(low, fd + 1)
    os.closerange(low, 65536)


def copy_tree(src: str, dst: str) -> None:
    """Copy a directory's contents, keeping modes, times and symlinks."""
    for entry in os.scandir(src):
        s, d = entry.path, os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(s), d)
        elif entry.is_dir():
            os.mkdir(d)
            copy_tree(s, d)
            shutil.copystat(s, d)
        elif entry.is_file():
            shutil.copy2(s, d)


def private_tmp(size_mib: int) -> None:
    """Replace /tmp with a new tmpfs holding a copy of the current one (needs our own mount ns)."""
    old = os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)
    try:
        linux.mount("tmpfs", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                    f"mode=1777,size={size_mib}m")
        copy_tree(f"/proc/self/fd/{old}", "/tmp")
    finally:
        os.close(old)


def prewarm_for_forks() -> None:
    """Load now what every fork would otherwise load (and dirty) on its own, then freeze the heap."""
    if "numpy" in sys.modules:
        import numpy.random  # noqa: F401 - each fork reseeds it
    gc.collect()
    gc.freeze()  # a fork's garbage collector then leaves the template's objects (and pages) alone


class SandboxProcess:
    """State of the one agent process this interpreter is. Copied by every fork, then updated."""

    def __init__(self, identity: dict, config: dict):
        self.identity = dict(identity)
        self.config = dict(config)  # host_network, tmp_size_mib
        self.runtime = Runtime(self.identity)
        self.fork_children: set[int] = set()
        self.pidns_fd = -1

    # --- becoming a template or a sandbox --------------------------------------------------------

    def serve(self, listen_fd: int, report_fd: int) -> None:
        """Report ready and serve forever (never returns)."""
        try:
            role = self.identity["role"]
            self.pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            listener = socket.socket(fileno=listen_fd)
            if role == "template":
                actions = {"spawn": self.spawn, "retire": self.retire}
                for frozen in ("exec", "eval", "run_code", "files"):
                    actions[frozen] = self._frozen
                prewarm_for_forks()
            else:
                actions = {"branch": self.branch, "retire": self.retire}
            install_reaper(skip=lambda pid: pid in self.runtime.procs, guard=self.runtime.procs_lock,
                           on_reaped=self.fork_children.discard)
            server = AgentServer(self.runtime, listener, actions, threaded=(role == "sandbox"))
            report(report_fd, {"id": self.identity["id"], "ok": True})
            os.close(report_fd)
            server.serve_forever()
        finally:
            os._exit(1)

    def become(self, identity: dict, listen_fd: int, report_fd: int) -> None:
        """In a fresh fork: take the new identity and namespaces, then serve (never returns)."""
        try:
            close_fds_except({0, 1, 2, listen_fd, report_fd})
            self.identity = dict(identity)
            self.fork_children = set()
            if identity["role"] == "sandbox":
                flags = linux.CLONE_NEWNS | linux.CLONE_NEWUTS | linux.CLONE_NEWIPC
                if not self.config.get("host_network"):
                    flags |= linux.CLONE_NEWNET
                linux.unshare(flags)
                linux.mount("proc", "/proc", "proc", _PROC_FLAGS)
                private_tmp(self.config["tmp_size_mib"])
                linux.mount("shm", "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=1777,size=64m")
                linux.sethostname(identity["id"][:64])
                if not self.config.get("host_network"):
                    linux.loopback_up()
            else:  # a branch: a new template that owns a frozen copy of the source's files
                linux.unshare(linux.CLONE_NEWNS)
                linux.mount("proc", "/proc", "proc", _PROC_FLAGS)
                private_tmp(self.config["tmp_size_mib"])
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            self.runtime.after_fork(self.identity)
        except BaseException as exc:  # noqa: BLE001
            with contextlib.suppress(Exception):
                report(report_fd, {"id": identity.get("id"), "ok": False,
                                   "error": f"{type(exc).__name__}: {exc}"})
            os._exit(1)
        self.serve(listen_fd, report_fd)

    # --- actions ---------------------------------------------------------------------------------

    def _frozen(self, request: dict, fds: list) -> dict:
        for fd in fds:
            os.close(fd)
        return {"error": f"{self.identity['id']} is a snapshot (frozen template): spawn a sandbox "
                         f"from it to run code", "exit_code": 1}

    def _fork_into_new_pidns(self) -> tuple[int, float]:
        """fork() so the child is PID 1 of a new pid namespace; returns (pid, seconds in fork)."""
        try:
            linux.unshare(linux.CLONE_NEWPID)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EUSERS):
                raise LineageTooDeep(
                    "lineage too deep: Linux nests pid namespaces at most 32 levels and every fork "
                    "generation (spawn or branch) takes one; branch from a shallower sandbox instead") from None
            raise
        t0 = time.perf_counter()
        pid = os.fork()
        elapsed = time.perf_counter() - t0
        if pid:
            # Point this thread's future children back at our own pid namespace.
            linux.setns(self.pidns_fd, linux.CLONE_NEWPID)
            self.fork_children.add(pid)
        return pid, elapsed

    def spawn(self, request: dict, fds: list) -> dict:
        children = request.get("children") or []
        if len(fds) != len(children) + 1:
            for fd in fds:
                os.close(fd)
            return {"error": f"spawn needs 1 report fd and {len(children)} listening fds, got {len(fds)}",
                    "exit_code": 1}
        report_fd, listen_fds = fds[0], fds[1:]
        pids = []
        try:
            for child, lfd in zip(children, listen_fds):
                identity = {"id": child["id"], "role": "sandbox",
                            "lineage": list(child.get("lineage") or [])}
                pid, _ = self._fork_into_new_pidns()
                if pid == 0:
                    self.become(identity, lfd, report_fd)
                pids.append(pid)
        finally:
            for fd in fds:
                os.close(fd)
        return {"pids": pids}

    def branch(self, request: dict, fds: list) -> dict:
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            return {"error": "branch needs a report fd and a listening fd", "exit_code": 1}
        identity = {"id": request["id"], "role": "template",
                    "lineage": list(request.get("lineage") or [])}
        prepare = 0.0
        if request.get("mode") == "live":
            # Smallest pause: compact our memory into huge pages first, while we keep running.
            t0 = time.perf_counter()
            linux.collapse_anonymous_memory()
            prepare = time.perf_counter() - t0
        try:
            pid, seconds = self._fork_into_new_pidns()
            if pid == 0:
                self.become(identity, fds[1], fds[0])
        finally:
            for fd in fds:
                os.close(fd)
        return {"pid": pid, "pause_ms": round(seconds * 1000, 3), "prepare_ms": round(prepare * 1000, 3)}

    def retire(self, request: dict, fds: list) -> dict:
        """Stop being this sandbox/template. Live forks keep a reaper in our place."""
        for fd in fds:
            os.close(fd)
        self.runtime.kill_children()
        alive = {pid for pid in self.fork_children if linux.process_start_time(pid) is not None}
        if not alive:
            return {"retired": "exit", "_then": lambda: os._exit(0)}

        def become_reaper():
            python = os.path.realpath(sys.executable)
            try:
                os.execv(python, [python, "-S", "-I", "-c", REAPER])
            except OSError:
                # Never die here: our death would take every fork nested in our pid namespace.
                exec(REAPER, {})  # noqa: S102 - same reaper, without releasing our memory
                os._exit(0)

        return {"retired": "reaper", "forks": len(alive), "_then": become_reaper}
