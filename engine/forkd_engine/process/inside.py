"""The process engine's side inside the sandbox: one agent process per template or sandbox.

A *template* (a snapshot) is a parked, warmed-up interpreter. ``spawn`` forks it: each child
starts a fresh pid namespace, with its own mount, network, IPC and UTS namespaces and a private
copy of /tmp. A *sandbox* serves the agent protocol; ``branch`` forks it into a new template, so the
source is paused only for the ``fork()`` itself.

A pid namespace dies with its PID 1, and every fork of a template or sandbox is nested in its
namespace. So the agent is never PID 1: the first process of each namespace forks the agent and
leaves PID 1 to forkd-init (``init.c``), which outlives the agent for as long as anything nested in
the namespace does, however the agent ends.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time

from .. import linux
from ..agent import children, generators, inventory
from ..agent.executor import Busy, Executor
from ..agent.runtime import Runtime
from ..agent.server import AgentServer, encode_line
from . import fanout
from .compactor import Compactor
from .sandbox_init import IN_SANDBOX
from .machine_id import own_machine_id

_PROC_FLAGS = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC


class LineageTooDeep(OSError):
    pass


LINEAGE_TOO_DEEP = ("lineage too deep: Linux nests pid namespaces at most 32 levels and every fork "
                    "generation (spawn or branch) takes one; branch from a shallower sandbox, or use the VM "
                    "engine (engine \"vm\"), which has no such limit")


def report(fd: int, message: dict) -> None:
    """Tell the engine how a start went. The kernel attaches our pid as the engine sees it."""
    with socket.socket(fileno=os.dup(fd)) as s:
        s.send(json.dumps(message).encode())


def report_ready(fd: int, message: dict) -> None:
    """Tell the engine we serve; if it is gone (the server died while we started), it never
    learnt of us and nobody would collect our init: end as unrecorded (never returns then)."""
    try:
        report(fd, message)
    except OSError:
        end_unrecorded()


MOVE_TIMEOUT = 30.0


def wait_to_be_moved(tag: str, report_fd: int) -> None:
    """A branch, right after its fork: it is still in its source's cgroup leaves, so the copies it
    is about to make (/tmp, /dev/shm) would count against the source's memory limit. Ask the engine
    to move it (and its init, its parent) into leaves of its own (the report carries our host pid)
    and wait until it has."""
    report(report_fd, {"id": tag, "move": True})
    with socket.socket(fileno=os.dup(report_fd)) as s:
        s.settimeout(MOVE_TIMEOUT)
        if s.recv(16) != b"moved":
            raise OSError("the engine did not move the branch into its own cgroup leaves")


def hand_pid1_to_init(guard: bool = False) -> socket.socket | None:
    """In the first process of a new pid namespace (its PID 1), first thing: fork, and leave PID 1
    to forkd-init while the child goes on as the template or sandbox. The init sets itself up (a
    /proc of its own) alongside, so the new sandbox waits only for this fork. With ``guard`` (a
    snapshot's own template), the init guards the snapshot's tree: the child gets the socket on
    which it sends its filter's listener (``send_listener``)."""
    if not os.access(IN_SANDBOX, os.X_OK):
        raise OSError(f"{IN_SANDBOX} is missing from the sandbox root: the engine binds it there")
    # What the child says to its init before the init runs must not be lost: PID 1 drops a signal
    # from inside its namespace that it neither handles nor blocks, but a blocked one waits, and
    # stays pending across exec (an agent ending before the engine recorded it asks at once).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
    # A session (and process group) of its own: a group signal sent by the source, a sibling or
    # the server's group (kill(0, ...), killpg) otherwise reaches every process forked from it.
    os.setsid()
    ours, inits = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if guard else (None, None)
    pid = children.raw_fork()
    if pid:
        try:
            argv = [IN_SANDBOX, str(pid)]
            if inits is not None:
                inits.set_inheritable(True)
                argv.append(str(inits.fileno()))
            os.execv(IN_SANDBOX, argv)
        finally:
            os._exit(127)  # no init: our exit ends the namespace, and the fork with it, loudly
    os.setpgid(0, 0)  # a group of our own, apart from our init's (pgid 1 cannot be signalled: -1 means all)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if inits is not None:
        inits.close()
    return ours


def send_listener(sock: socket.socket, listener: int) -> None:
    """Hand the seccomp filter's listener to the guard (our init), and keep no copy of it: a fork
    that held it could answer its own calls."""
    try:
        socket.send_fds(sock, [b"L"], [listener])
    finally:
        os.close(listener)
        sock.close()


def end_unrecorded() -> None:
    """Exit before the engine has recorded us: no one will ask our init how we ended, so it
    need not wait to be asked (never returns)."""
    if os.getpid() != 1:
        with contextlib.suppress(OSError):
            os.kill(1, signal.SIGTERM)
    os._exit(1)


def refuse_and_end(conns: list[int], error: str) -> None:
    """A sandbox that reported ready from the C loop and then failed to set itself up: answer
    what waits on its connections with ``error`` and end (never returns). Its init outlives it
    and tells the engine how it ended."""
    line = encode_line({"error": error, "exit_code": 1})
    for fd in conns:
        with contextlib.suppress(OSError):
            os.write(fd, line)
        with contextlib.suppress(OSError):  # what is left unread on a closing socket resets it, losing the reply
            os.set_blocking(fd, False)
            while os.read(fd, 1 << 16):
                pass
    os._exit(1)


def close_agent_fds(fds: set[int], keep: set[int]) -> None:
    """Close the agent's descriptors except ``keep``; the user's own open files stay open."""
    for fd in fds - keep - {0, 1, 2}:
        with contextlib.suppress(OSError):
            os.close(fd)


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


def private_copy(path: str, size_mib: int) -> None:
    """Replace the mount at ``path`` (/tmp, /dev/shm) with a new tmpfs holding a copy of the current
    one (needs our own mount namespace). It is ``size_mib`` large, or larger when the copy needs it:
    a copy never fails for want of room its source had."""
    old = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.statvfs(f"/proc/self/fd/{old}")
        used_mib = (st.f_blocks - st.f_bfree) * st.f_frsize >> 20
        size_mib = max(size_mib, used_mib + 64)
        linux.mount("tmpfs", path, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, f"mode=1777,size={size_mib}m")
        copy_tree(f"/proc/self/fd/{old}", path)
    finally:
        os.close(old)


IDLE_COPY_MAX = 1 << 20  # bytes in /tmp and /dev/shm a spawn's child may copy at its first use, not before


def _used_bytes(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def prewarm_for_forks(after_setup: bool) -> None:
    """Load now what every fork would otherwise load (and dirty) on its own, then freeze the heap.

    After a snapshot's setup, also import what forks of numpy code are likely to use (numpy.random),
    reseed and collect the setup's garbage. A branch's template does none of it: it reseeded as it
    became one (``Runtime.after_fork``), and its set-up is what the branch's caller waits for
    (numpy.random takes 20 ms; a full collection grows with the heap: 6 ms after ``import numpy``
    in a cell). The source's garbage not yet collected then stays in the snapshot (the source
    collects its own), shared by every copy."""
    if after_setup:
        if "numpy" in sys.modules:
            import numpy.random  # noqa: F401
        # Reseed here once too: what the first reseed frees or settles (numpy's import-time seed
        # sequence, entropy drawn since the last cell) is then gone before the fork, and each copy's
        # own reseed only writes new state. The template draws nothing: its copies reseed again.
        generators.reseed()
        gc.collect()
    gc.freeze()  # a fork's garbage collector then leaves the template's objects (and pages) alone


class SandboxProcess:
    """State of the one agent process this interpreter is. Copied by every fork, then updated."""

    def __init__(self, identity: dict, config: dict):
        self.identity = dict(identity)
        self.config = dict(config)  # host_network, tmp_size_mib, shm_size_mib (MiB), lossy
        self.runtime = Runtime(self.identity)
        self.pidns_fd = -1
        self.server: AgentServer | None = None
        self.fork_plan: dict | None = None  # a parked template's: what each copy repairs (inventory.fork_plan)
        # A parked template's: each copy's main thread, made once here (made in each copy, it dirtied
        # the pages of all it touches: private memory of every idle sandbox), unused until then.
        self.spare_executor: Executor | None = None

    def agent_fds(self) -> set[int]:
        fds = children.agent_fds() | ({self.pidns_fd} if self.pidns_fd >= 0 else set())
        return fds | (self.server.agent_fds() if self.server is not None else set())

    def lost(self, running: tuple[str, float] | None) -> list[str]:
        """What a fork now would not carry: the user's, never the agent's own connections."""
        address = self.server.address() if self.server is not None else None
        return inventory.lost(self.agent_fds(), running, address)

    # --- becoming a template or a sandbox --------------------------------------------------------

    def serve(self, listen_fd: int, report_fd: int | None, warnings: list[str] | None = None, *,
              after_setup: bool = False, handed: list[int] = ()) -> None:
        """Report ready (with ``warnings``: what a lossy setup left running) and serve forever
        (never returns). ``after_setup``: a snapshot's template, made by its setup (not a branch).
        No ``report_fd``: a sandbox that reported ready already, from the C loop where it idled
        (fanout.c), and serves the connections it accepted there (``handed``) too.

        A template serves on this thread, one request at a time (it only spawns). A sandbox accepts
        on a thread and runs user code, and its forks, on this one: the main thread."""
        try:
            role = self.identity["role"]
            self.pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            listener = socket.socket(fileno=listen_fd)
            # A template's reaper has a thread of its own (this one serves a spawn at a time); a
            # sandbox's accepting thread doubles as its reaper.
            children.install(reaper_thread=role == "template")
            if role == "template":
                actions = {"spawn": self.spawn, "retire": self.retire}
                for frozen in ("exec", "eval", "run_code", "files"):
                    actions[frozen] = self._frozen
                self.runtime.executor = None
                self.spare_executor = Executor()
                self.fork_plan = inventory.fork_plan(self.agent_fds() | {listen_fd, report_fd})
                prewarm_for_forks(after_setup)
                self.server = AgentServer(self.runtime, listener, actions, threaded=False)
                report_ready(report_fd, {"id": self.identity["id"], "ok": True, **({"warnings": warnings} if warnings else {})})
                os.close(report_fd)
                self.server.serve_forever()
            else:
                executor = self.runtime.executor = self.spare_executor or Executor()
                self.spare_executor = None
                self.compactor = Compactor(executor, self.runtime.namespace,
                                           huge_pages_mib=int(self.identity.get("huge_pages_mib") or 0))
                executor.after_user_code = self.compactor.poke
                self.server = AgentServer(self.runtime, listener,
                                          {"branch": self.branch, "retire": self.retire,
                                           "inventory": self.inventory}, threaded=True,
                                          tend=(children.wake_fd(), children.tend, children.TEND_EVERY))
                self.server.start()
                for fd in handed:
                    threading.Thread(target=self.server.serve_connection, args=(socket.socket(fileno=fd),),
                                     name="forkd-conn", daemon=True).start()
                if report_fd is not None:
                    report_ready(report_fd, {"id": self.identity["id"], "ok": True})
                    os.close(report_fd)
                executor.run_forever()
        finally:
            os._exit(1)

    def sandbox_namespaces(self) -> int:
        """The namespaces a sandbox takes of its own, besides its pid namespace (flags for unshare)."""
        flags = linux.CLONE_NEWNS | linux.CLONE_NEWUTS | linux.CLONE_NEWIPC
        return flags if self.config.get("host_network") else flags | linux.CLONE_NEWNET

    def _own_namespaces(self, identity: dict, listen_fd: int, report_fd: int) -> None:
        """Close the agent's descriptors but ours, take namespaces of our own and our /proc, and
        (a sandbox) our hostname and lo: what a spawn's C loop does for each child (fanout.c)."""
        # A template serves one connection at a time on this thread, recorded before it is
        # served; a sandbox's accepting thread may hold one it has not recorded yet.
        threaded = self.server is not None and self.server.threaded
        accepted = inventory.connections_to(self.server.address()) if threaded else set()
        close_agent_fds(self.agent_fds() | accepted, keep={listen_fd, report_fd})
        if identity["role"] == "sandbox":
            linux.unshare(self.sandbox_namespaces())
        else:  # a branch: a new template that owns a frozen copy of the source's files
            wait_to_be_moved(identity["id"], report_fd)
            linux.unshare(linux.CLONE_NEWNS)
        linux.mount("proc", "/proc", "proc", _PROC_FLAGS)
        if identity["role"] == "sandbox":
            linux.sethostname(identity["id"][:64])
            if not self.config.get("host_network"):
                linux.loopback_up()

    def become(self, identity: dict, listen_fd: int, report_fd: int, lossy: bool = False,
               tmpfs: dict | None = None, forked_by_loop: bool = False) -> None:
        """In a fresh fork: leave PID 1 to forkd-init, close the agent's descriptors, take the new
        identity, namespaces and private copies of /tmp and /dev/shm (sized by ``tmpfs``, else as
        ours), repair what the fork shares with its source, then serve (never returns). With
        ``forked_by_loop`` (a spawn's C loop), forkd-init runs and the namespaces, hostname and
        machine id are ours already."""
        # A spawn's copy of a parked template repairs what the template found once; a branch's
        # copy of a sandbox, where user code ran, looks afresh.
        plan, self.fork_plan = self.fork_plan, None
        # A spawn's child that idled in the C loop reported ready there: what follows was left for
        # its first request (not a ping), which waits in one of these connections.
        handed = fanout.handover() if forked_by_loop else None
        try:
            if forked_by_loop:
                failed = fanout.set_up_error()
                if failed:
                    raise OSError(failed)
            else:
                hand_pid1_to_init()
                self._own_namespaces(identity, listen_fd, report_fd)
            self.config.update(tmpfs or {})
            children.forget_fds()
            self.server = None
            self.pidns_fd = -1
            self.identity = dict(identity)
            cwd = os.getcwd()
            private_copy("/tmp", self.config["tmp_size_mib"])
            private_copy("/dev/shm", self.config.get("shm_size_mib", 64))
            # The same path now names this fork's own copy (a relative open() stays private).
            with contextlib.suppress(OSError):
                os.chdir(cwd)
            if identity["role"] == "sandbox" and not forked_by_loop:
                own_machine_id()
            notes = inventory.repair_after_fork({listen_fd, report_fd}, lossy, plan)
            if notes:
                raise OSError(f"could not give the fork its own copy of: {'; '.join(notes)}")
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            self.runtime.after_fork(self.identity)
        except BaseException as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
            if handed is not None:  # running already: the requests waiting are told, and it ends
                refuse_and_end(handed[0], f"{identity.get('id')} could not set itself up after its spawn: {error}")
            with contextlib.suppress(Exception):
                report(report_fd, {"id": identity.get("id"), "ok": False, "error": error})
            end_unrecorded()
        if handed is None:
            self.serve(listen_fd, report_fd)
        else:
            conns, self.runtime.started = handed
            self.serve(listen_fd, None, handed=conns)

    # --- actions ---------------------------------------------------------------------------------

    def _frozen(self, request: dict, fds: list) -> dict:
        for fd in fds:
            os.close(fd)
        return {"error": f"{self.identity['id']} is a snapshot (frozen template): spawn a sandbox "
                         f"from it to run code", "exit_code": 1}

    def _fork_into_new_pidns(self) -> tuple[int, float]:
        """fork() so the child is the first process (PID 1) of a new pid namespace, which it hands to
        forkd-init (``become``); returns (pid, seconds in fork)."""
        try:
            linux.unshare(linux.CLONE_NEWPID)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EUSERS):
                raise LineageTooDeep(LINEAGE_TOO_DEEP) from None
            raise
        t0 = time.perf_counter()
        pid = children.raw_fork()
        elapsed = time.perf_counter() - t0
        if pid:
            # Point this thread's future children back at our own pid namespace.
            linux.setns(self.pidns_fd, linux.CLONE_NEWPID)
        return pid, elapsed

    def spawn(self, request: dict, fds: list) -> dict:
        children_spec = request.get("children") or []
        if len(fds) != len(children_spec) + 1:
            for fd in fds:
                os.close(fd)
            return {"error": f"spawn needs 1 report fd and {len(children_spec)} listening fds, got {len(fds)}",
                    "exit_code": 1}
        report_fd, listen_fds = fds[0], fds[1:]
        kids = [({"id": child["id"], "role": "sandbox", "lineage": list(child.get("lineage") or []),
                  "huge_pages_mib": int(child.get("huge_pages_mib") or 0)},
                 {k: int(child[k]) for k in ("tmp_size_mib", "shm_size_mib") if child.get(k)})
                for child in children_spec]  # all made before the first fork: the loop writes nothing
        try:
            # The children idle in the C loop until first used, and copy /tmp and /dev/shm then, into
            # their own leaves; unless those hold more than a little (a notebook's holds IPython's
            # profile), whose copy is not to be charged to a child's memory limit (a copy is never
            # short of room): those children copy before they report.
            idle = _used_bytes("/tmp") + _used_bytes("/dev/shm") <= IDLE_COPY_MAX
            agents = fanout.Agents(self.sandbox_namespaces(), self.agent_fds(), report_fd, listen_fds,
                                   [identity["id"] for identity, _ in kids],
                                   ready_lines=[json.dumps({"id": identity["id"], "ok": True}).encode()
                                                for identity, _ in kids] if idle else None,
                                   ping_formats=[Runtime.ping_format(identity) for identity, _ in kids])
            index, pids = self._fork_children(len(kids), agents)
            if index:
                identity, tmpfs = kids[index - 1]
                # A snapshot whose setup left running work (accepted with lossy) hands it to no one.
                self.become(identity, listen_fds[index - 1], report_fd, lossy=bool(self.config.get("lossy")),
                            tmpfs=tmpfs, forked_by_loop=fanout.loaded())
        finally:
            for fd in fds:
                os.close(fd)
        return {"pids": pids}

    def _fork_children(self, n: int, agents: fanout.Agents) -> tuple[int, list[int]]:
        """Fork ``n`` children, each PID 1 of a new pid namespace: (its index counted from 1, []) in a
        child, (0, their pids) here. In one C loop where the bootstrap loaded it (fanout.py), whose
        children have handed PID 1 to forkd-init and set up as ``agents`` says already, each
        returning here as its agent."""
        if not fanout.loaded():
            pids = []
            for i in range(n):
                pid, _ = self._fork_into_new_pidns()
                if pid == 0:
                    return i + 1, []  # become() hands PID 1 over
                pids.append(pid)
            return 0, pids
        try:
            return fanout.fork_children(n, self.pidns_fd, IN_SANDBOX, agents)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EUSERS):
                raise LineageTooDeep(LINEAGE_TOO_DEEP) from None
            if exc.filename == IN_SANDBOX:
                raise OSError(f"{IN_SANDBOX} is missing from the sandbox root: the engine binds it there") from None
            raise

    def inventory(self, request: dict, fds: list) -> dict:
        for fd in fds:
            os.close(fd)
        return {"lost": self.lost(self.runtime.executor.busy())}

    def branch(self, request: dict, fds: list) -> dict:
        """Fork this sandbox into a new template. On the main thread when it is idle, so the copy
        continues with its shell and namespace; while a cell runs, only with ``lossy`` (the cell
        does not go on in the copy)."""
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            return {"error": "branch needs a report fd and a listening fd", "exit_code": 1}
        lossy = bool(request.get("lossy"))
        identity = {"id": request["id"], "role": "template", "lineage": list(request.get("lineage") or [])}
        try:
            def fork_here(running=None) -> dict:
                lost = self.lost(running)
                if lost and not lossy:
                    return {"error": "lossy fork refused", "lost": lost, "exit_code": 1}
                t0 = time.perf_counter()
                with self.compactor.stopped():  # an idle sandbox's memory is in huge pages already
                    prepared = time.perf_counter() - t0
                    pid, seconds = self._fork_into_new_pidns()
                if pid == 0:
                    self.become(identity, fds[1], fds[0], lossy=lossy)
                self.compactor.poke()  # what a cell split since, once idle
                return {"pid": pid, "pause_ms": round(seconds * 1000, 3), "prepare_ms": round(prepared * 1000, 3),
                        "warnings": lost}

            executor = self.runtime.executor
            if lossy and executor.busy() is not None:
                return fork_here(executor.busy())  # now, mid-cell: what the cell was doing is lost, and said so
            try:
                return executor.call(fork_here, "a branch", user_code=False, start_within=1.0)
            except Busy:
                running = executor.busy()
                if not lossy:
                    return {"error": "lossy fork refused", "exit_code": 1,
                            "lost": self.lost(running or ("a request", time.time()))}
                return fork_here(running)  # here, on this thread: the main thread is busy
        finally:
            for fd in fds:
                os.close(fd)

    def retire(self, request: dict, fds: list) -> dict:
        """Stop being this sandbox or template (for an engine that has no handle of it to kill).
        Our init holds what is nested in our namespace and goes after it; it need not wait for
        anyone to ask how we ended."""
        for fd in fds:
            os.close(fd)
        self.runtime.kill_children()
        with contextlib.suppress(OSError):
            os.kill(1, signal.SIGTERM)
        return {"retired": "exit", "_then": lambda: os._exit(0)}
