"""The process engine, host side: Linux namespaces + seccomp + cgroups around forked interpreters.

Templates and sandboxes are independent processes (not children of the server), each reachable on
a Unix socket this engine binds in its run directory and hands over with SCM_RIGHTS, so nothing
inside a sandbox ever writes to the host's filesystem. Each fresh fork reports on a SOCK_SEQPACKET
pair with SO_PASSCRED set: the kernel stamps the report with the sender's pid as the host sees it.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .. import linux
from ..agent.client import AgentClient, AgentSession, AgentUnavailable
from ..agent.kept import KeptConnections
from ..base import (AgentUnreachable, BranchResult, Cancelled, ChildSpec, EngineError, EngineUnavailable, ExitStatus,
                    Handle, InvalidSpec, LimitHit, LimitReached, LossyFork, PROBE_PARALLELISM, SnapshotSpec,
                    ping_problem)
from . import fanout, hugepages, reserve, rootfs, sandbox_init
from .setup import Setup
from ..cgroups import CgroupError, Cgroups, leaf_name, subtree

SPAWN_BATCH = 200  # under the kernel's 253 fds per message
_UCRED = "3i"
MAX_SOCKET_PATH = 107
AGENT_OOM_SCORE_ADJ = -900
DEFAULT_MEMORY_LIMIT_MIB = 2048  # a sandbox's (and a snapshot setup's) memory limit unless one is asked for
DEFAULT_PIDS_MAX = 1024          # processes and threads per sandbox (and per snapshot setup)
RETIRE_TIMEOUT = 10.0   # s an agent of a handle without an init has to answer "retire" (see _retire)
INIT_REPORT_WAIT = 2.0  # s an init has to say how its agent ended (it reaps at once: a loaded host's moment)
KILL_WAIT = 10.0        # s a killed agent has to exit (SIGKILL: only a process stuck in the kernel takes long)
ABANDON_TIMEOUT = 5.0   # s an agent no record names has to answer "retire" before it is killed


def _import_path() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(p)]


def _sandbox_env() -> dict:
    bindir = os.path.dirname(sys.executable)
    return {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join(rootfs.sandbox_path(p) for p in _import_path()),
        "PYTHONDONTWRITEBYTECODE": "1",
        "FORKD_SANDBOX": "1",
    }


def tmpfs_sizes(memory_limit_mib: int) -> tuple[int, int]:
    """Sizes (MiB) of a sandbox's /tmp and /dev/shm: a half and a quarter of its memory limit. Their
    files are memory charged to that limit anyway; the sizes make a full tmpfs say ENOSPC first."""
    return max(64, memory_limit_mib // 2), max(64, memory_limit_mib // 4)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)



class EngineTimeout(EngineError):
    """No report came before the deadline."""


def _failure(what: str, error: str) -> EngineError:
    """The engine error for an agent's ``error``: a nesting limit is the request's, said as such."""
    if "LineageTooDeep" in error:
        return LimitReached(error.split("LineageTooDeep: ", 1)[-1])
    return EngineError(f"{what}: {error}")


def _guarded(parent: Handle) -> dict:
    """What a fork's handle says of the signal guard: a fork is guarded as its parent's tree is (the
    filter and its listener come with the fork; a snapshot made before the guard has none)."""
    return {"signal_guard": True} if parent.get("signal_guard") else {}


UNGUARDED = ("made by an older forkd, without the signal guard: its sandboxes can signal (and kill) "
             "its branches, their sandboxes and each other; make the snapshot again to guard them")


class ProcessEngine:
    name = "process"
    # Its snapshots are parked processes, as its sandboxes are: a restart of the host ends them all,
    # so the controller records them without waiting for the disk (registry.py).
    snapshots_are_processes = True

    def __init__(self, data_dir: str, *, sandbox_uid: int = 65534, sandbox_gid: int = 65534,
                 memory_limit_mib: int = DEFAULT_MEMORY_LIMIT_MIB, pids_max: int = DEFAULT_PIDS_MAX,
                 spawn_timeout: float = 60.0):
        if os.geteuid() != 0:
            raise EngineUnavailable(
                "the process engine needs root: it builds each sandbox's read-only root and maps "
                "sandbox root to an unprivileged uid. Run the server as root (e.g. sudo forkd serve)")
        self.data_dir = os.path.realpath(data_dir)
        self.run_dir = os.path.join(self.data_dir, "run")
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        if len(os.path.join(self.run_dir, "x" * 24)) > MAX_SOCKET_PATH:
            raise EngineUnavailable(f"data dir {self.data_dir!r} is too long for Unix socket paths "
                                    f"({MAX_SOCKET_PATH} bytes); choose a shorter --data-dir")
        try:
            rootfs.check_python_location()
            self.init_path = sandbox_init.build()  # PID 1 of every namespace we make
            self.fanout_path = fanout.build()       # a template's fork loop for spawns
        except (RuntimeError, OSError) as exc:
            raise EngineUnavailable(str(exc)) from None
        self.root_dir = os.path.join(self.data_dir, "newroot")
        os.makedirs(self.root_dir, exist_ok=True)
        self.uid, self.gid = sandbox_uid, sandbox_gid
        self.default_memory_limit_mib = memory_limit_mib
        self.pids_max = pids_max
        self.spawn_timeout = spawn_timeout
        self._pidfds: dict[tuple[int, int], int] = {}  # (pid, start time) -> pidfd
        self._pidfd_lock = threading.Lock()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one pidfd per live process
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.cgroups = Cgroups(subtree("forkd", self.data_dir))  # this server's own leaves
        self.cgroups.sweep()
        # Big arrays move into hugetlb pages (process/hugepages.py), up to each sandbox's cap: only
        # where each leaf's huge pages can be capped (they are not charged to its memory limit);
        # elsewhere sandboxes may map none at all (their seccomp filter refuses MAP_HUGETLB).
        self.huge_pages, self.huge_pages_note = hugepages.allow_surplus(self.cgroups.hugetlb_status())
        # Free huge pages the host backs already, for the copies a write after a branch makes (reserve.py)
        self.huge_page_reserve = reserve.start() if self.huge_pages else None
        self.started = time.time()  # what recover() may end predates this
        self._creating: dict[str, Setup] = {}  # tag -> its setup, while it runs
        self._creating_lock = threading.Lock()
        self.kept = KeptConnections()  # the event loop's connections to agents, for short calls

    # --- sockets and reports ---------------------------------------------------------------------

    def _socket_path(self, name: str) -> str:
        digest = hashlib.sha1(name.encode()).hexdigest()[:20]
        return os.path.join(self.run_dir, f"{digest}.sock")

    def _listen(self, name: str) -> tuple[socket.socket, str]:
        path = self._socket_path(name)
        _unlink(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o600)
        s.listen(128)
        return s, path

    @staticmethod
    def _report_pair() -> tuple[socket.socket, socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        return ours, theirs

    @staticmethod
    def _read_report(sock: socket.socket, deadline: float) -> tuple[dict, int] | None:
        """One report and the host pid of its sender, or None when every sender has gone."""
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data, anc, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(12))
        except socket.timeout:
            raise EngineTimeout("timed out waiting for a sandbox to start") from None
        if not data:
            return None
        pid = 0
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = array.array("i", payload[:12])[0]
        return json.loads(data), pid

    def _handle(self, pid: int, path: str, **extra) -> Handle:
        """The handle of a template or sandbox whose agent is ``pid``; its parent is its init."""
        start = linux.process_start_time(pid)
        init = linux.parent_pid(pid)
        init_start = linux.process_start_time(init) if init else None
        if start is None or init_start is None:
            raise EngineError(f"process {pid} exited right after starting")
        # Where root holds CAP_SYS_RESOURCE, also shield the agent itself from the OOM killer
        # (its death takes the whole pid namespace); without it, this is refused and harmless.
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/oom_score_adj", "w") as f:
                f.write(str(AGENT_OOM_SCORE_ADJ))
        return {"engine": self.name, "pid": pid, "start_time": start, "socket": path,
                "init": {"pid": init, "start_time": init_start}, **extra}

    # --- agent -----------------------------------------------------------------------------------

    def call(self, handle: Handle, request: dict, timeout: float | None = None, fds: list[int] | None = None) -> dict:
        try:
            return AgentClient(handle["socket"], timeout=timeout or 30.0).call(request, fds=fds)
        except AgentUnavailable as exc:
            raise AgentUnreachable(str(exc)) from exc

    async def call_async(self, handle: Handle, request: dict | bytes, timeout: float | None = None,
                         long: bool = False) -> dict:
        """``call`` on the running event loop, on a connection kept for this agent process
        (agent/kept.py): never blocks the loop; ``BlockingIOError`` where ``call`` would wait (the
        agent's listen queue is full). ``request`` may be its line, encoded once (``encode_line``).
        Short calls (pings) share one connection; ``long``: a call that may take a while (an eval)
        goes on a second one, so the pings behind it are not held up (the agent answers each
        connection's requests in order). Long calls are sent one at a time (the sandbox's lane), and
        one given up on closes its connection (``KeptConnections.call``'s ``alone``)."""
        key = (handle["socket"], handle["pid"], handle["start_time"]) + (("long",) if long else ())
        try:
            return await self.kept.call(key, handle["socket"], request, timeout or 30.0, alone=long)
        except AgentUnavailable as exc:
            raise AgentUnreachable(str(exc)) from exc

    def open_session(self, handle: Handle, **options) -> AgentSession:
        """A streaming session with the sandbox's agent (``shell="ipython"`` for the notebook shell)."""
        try:
            return AgentSession(handle["socket"], options)
        except AgentUnavailable as exc:
            raise AgentUnreachable(str(exc)) from exc

    def alive(self, handle: Handle) -> bool:
        return self.alive_many([handle])[0]

    def alive_many(self, handles: list[Handle], block: bool = True) -> list[bool]:
        """Liveness of many processes in one poll(): each is watched through a pidfd, opened once.

        The pidfd is kept only if the process it names has the recorded start time, so it stays
        bound to that exact process even if its pid is later reused. ``block=False`` (the event
        loop): ``BlockingIOError`` rather than waiting while another thread checks its own.
        """
        if not self._pidfd_lock.acquire(blocking=block):
            raise BlockingIOError("another thread is checking which processes live")
        try:
            return self._alive_held(handles)
        finally:
            self._pidfd_lock.release()

    def _alive_held(self, handles: list[Handle]) -> list[bool]:
        fds, unwatched = [], {}  # unwatched: index -> liveness read from /proc (no pidfd to be had)
        for i, h in enumerate(handles):
            key = (h["pid"], h["start_time"])
            fd = self._pidfds.get(key)
            if fd is None:
                try:
                    fd = os.pidfd_open(h["pid"])
                except ProcessLookupError:
                    fd = -1
                except OSError:  # out of descriptors, say: that is no death
                    unwatched[i] = linux.process_start_time(h["pid"]) == h["start_time"]
                    fds.append(-1)
                    continue
                if fd >= 0 and linux.process_start_time(h["pid"]) != h["start_time"]:
                    os.close(fd)
                    fd = -1
                if fd >= 0:
                    self._pidfds[key] = fd
            fds.append(fd)
        poller = select.poll()
        for fd in {f for f in fds if f >= 0}:
            poller.register(fd, select.POLLIN)
        exited = {fd for fd, _ in poller.poll(0)}  # a pidfd turns readable when its process exits
        if exited:  # (the pidfds of every sandbox watched are looked through only then)
            for key, fd in list(self._pidfds.items()):
                if fd in exited:
                    os.close(fd)
                    del self._pidfds[key]
        return [unwatched[i] if i in unwatched else fd >= 0 and fd not in exited for i, fd in enumerate(fds)]

    def wait_exit(self, handle: Handle, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the process to exit; True once it has."""
        return linux.wait_exit(handle["pid"], handle["start_time"], timeout)

    def limits_hit(self, handle: Handle) -> list[LimitHit]:
        """The limits the kernel enforced in this sandbox's leaves (read before ``kill`` removes them)."""
        return self.cgroups.hits(handle.get("cgroups") or [])

    def raise_memory_limit(self, handle: Handle, memory_mib: int) -> None:
        """Raise a running sandbox's memory limit and huge-page cap (its leaves'). Its /tmp and
        /dev/shm keep the sizes they were mounted with, and its compactor keeps moving arrays into
        huge pages up to the cap it started with: only the kernel's limits move."""
        try:
            self.cgroups.raise_memory(handle.get("cgroups") or [], memory_mib)
        except OSError as exc:
            raise EngineError(f"could not raise the memory limit of process {handle.get('pid')}: {exc}") from exc

    def exit_status(self, handle: Handle) -> ExitStatus | None:
        """How its agent ended, as its init says (None while it runs, or for a handle without an
        init: one a server before forkd-init made). The init says so a moment after the agent's
        exit, once it has reaped it; we give it that moment."""
        init = handle.get("init")
        if init is None or self.alive(handle):
            return None
        deadline = time.monotonic() + INIT_REPORT_WAIT
        while True:
            status = sandbox_init.ending(init["pid"], init["start_time"])
            if status is not None or linux.process_start_time(init["pid"]) != init["start_time"] \
                    or time.monotonic() > deadline:
                return status
            time.sleep(0.002)

    def probe(self, handles: list[Handle], timeout: float = 5.0) -> list[str | None]:
        """Why each process does not answer a ping within ``timeout`` (None: it does), all at once."""
        why: list[str | None] = [None if ok else f"its process {h['pid']} is gone"
                                 for h, ok in zip(handles, self.alive_many(handles))]
        live = [i for i, w in enumerate(why) if w is None]

        def ping(handle: Handle) -> str | None:
            return ping_problem(lambda request: self.call(handle, request, timeout=timeout))

        if live:
            with ThreadPoolExecutor(max_workers=min(PROBE_PARALLELISM, len(live))) as pool:
                for i, w in zip(live, pool.map(ping, [handles[i] for i in live])):
                    why[i] = w
        return why

    def repair(self, handle: Handle) -> list[str]:
        """Nothing to repair: a template or sandbox is whole while its process lives."""
        return []

    def snapshot_warnings(self, handle: Handle) -> list[str]:
        """A snapshot made before the signal guard (docs/design/process-engine.md) says so."""
        return [] if handle.get("signal_guard") else [UNGUARDED]

    def warm_up(self) -> None:
        """Nothing: what the process engine needs it makes as it starts (all of it cheap)."""

    def recover(self, known: list[Handle]) -> list[str]:
        """Files in the run directory no known handle names: starts a previous server never
        recorded. Whatever still serves on such a socket is ended (all at once); the files are
        removed. Only what is older than the engine: a start of its own may be under way."""
        named = {h.get("socket") for h in known}
        sockets, found = [], []
        for entry in os.scandir(self.run_dir):
            if entry.path in named:
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime >= self.started:
                    continue
            if entry.name.endswith(".sock"):
                sockets.append(entry.path)
            elif entry.name.endswith(".log"):  # a snapshot's start-up log, kept only while it starts
                found.append(f"process engine: removed the log of a snapshot start no record names, {entry.path}")
                _unlink(entry.path)
        if sockets:
            with ThreadPoolExecutor(max_workers=min(PROBE_PARALLELISM, len(sockets))) as pool:
                for path, how in zip(sockets, pool.map(self._end_behind, sockets)):
                    found.append(f"process engine: {how}, at {path}")
        return found

    def _end_behind(self, path: str) -> str:
        """End whatever serves on socket ``path`` that no record names, and remove the socket: it is
        asked to retire; one that does not answer is killed (found by the socket it holds)."""
        try:
            try:
                AgentClient(path, timeout=ABANDON_TIMEOUT).call({"action": "retire"})
                return "retired an agent no record names"
            except (AgentUnavailable, OSError, ValueError):
                pass
            killed = []
            for pid in linux.socket_holders(path):
                init = linux.parent_pid(pid)
                if init is None or sandbox_init.ending(init, linux.process_start_time(init)) is not None:
                    continue
                with contextlib.suppress(OSError), open(f"/proc/{init}/comm") as f:
                    if not f.read().startswith(sandbox_init.NAME):
                        continue  # no init of ours above it: not an agent this engine made
                    start, init_start = linux.process_start_time(pid), linux.process_start_time(init)
                    if start is not None and init_start is not None:
                        self._end({"pid": pid, "start_time": start, "socket": path,
                                   "init": {"pid": init, "start_time": init_start}})
                        killed.append(pid)
            if killed:
                return f"killed an agent no record names that did not answer (pid {', '.join(map(str, killed))})"
            return "removed a socket no record names"
        finally:
            _unlink(path)

    def memory(self, handle: Handle) -> dict:
        if not self.alive(handle):
            raise EngineError(f"process {handle['pid']} is gone")
        rollup = linux.smaps_rollup(handle["pid"])
        out = linux.memory_figures(rollup)
        # Arrays moved into hugetlb pages are outside Rss/Pss: count them in (a shared one whole in
        # Rss only, as the kernel gives no per-process share of it).
        private, shared = rollup.get("Private_Hugetlb", 0), rollup.get("Shared_Hugetlb", 0)
        out["rss_kib"] += private + shared
        out["pss_kib"] += private
        out["uss_kib"] += private
        init = handle.get("init")
        if init and linux.process_start_time(init["pid"]) == init["start_time"]:
            with contextlib.suppress(OSError, ValueError):  # its init: a few pages, but the sandbox's own
                extra = linux.memory_figures(linux.smaps_rollup(init["pid"]))
                for key in ("rss_kib", "pss_kib", "uss_kib"):
                    out[key] += extra[key]
        return out

    # --- snapshots -------------------------------------------------------------------------------

    def create_snapshot(self, spec: SnapshotSpec) -> Handle:
        """Start a template and run the setup in it, within a sandbox's limits (setup.py); the whole
        creation has ``spec.setup_timeout`` seconds. ``cancel(tag)`` stops it."""
        memory_mib = spec.memory_limit_mib or self.default_memory_limit_mib
        tmp_mib, shm_mib = tmpfs_sizes(memory_mib)
        listener, path = self._listen("snap:" + spec.tag)
        ours, theirs = self._report_pair()
        log_path = path[:-5] + ".log"
        cfg = {
            "tag": spec.tag, "setup": spec.setup, "setup_commands": spec.setup_commands,
            "host_network": spec.host_network, "setup_timeout": spec.setup_timeout,
            "tmp_size_mib": tmp_mib, "shm_size_mib": shm_mib, "uid": self.uid, "gid": self.gid,
            "root_dir": self.root_dir, "hidden": [self.data_dir], "init": self.init_path, "fanout": self.fanout_path,
            "env": _sandbox_env(),
            "listen_fd": listener.fileno(), "report_fd": theirs.fileno(), "lossy": spec.lossy,
            "shell": spec.shell, "deny_hugetlb": not self.cgroups.caps_huge_pages,
        }
        setup = Setup(self.cgroups, spec.tag, memory_mib, self.pids_max)
        with self._creating_lock:
            self._creating[spec.tag] = setup  # one creation per tag: the controller holds the tag
        deadline = time.monotonic() + spec.setup_timeout
        got = None
        try:
            setup.start(cfg, dict(os.environ, PYTHONPATH=os.pathsep.join(_import_path())),
                        (listener.fileno(), theirs.fileno()), log_path)
            listener.close()
            theirs.close()
            got = self._read_report(ours, deadline)
        except EngineTimeout:
            setup.stop()  # past its deadline: everything it started
        except BaseException as exc:
            self._end_setup(setup, path, log_path)
            if setup.cancelled:
                raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created; its setup was "
                                f"stopped") from exc
            raise
        finally:
            ours.close()
            listener.close()
            theirs.close()
        with self._creating_lock:  # from here on cancel() no longer finds it: cancelled now, or never
            self._creating.pop(spec.tag, None)
        if setup.cancelled or got is None or not got[0].get("ok"):
            limits = setup.limits_hit()
            detail = (got[0].get("error") if got else self._log_tail(log_path)) + limits
            self._end_setup(setup, path, log_path)
            if setup.cancelled:
                raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created; its setup was stopped")
            # The request's own setup failed, ran out of time or hit a limit: a 400, not an engine failure.
            if time.monotonic() >= deadline:
                raise InvalidSpec(f"snapshot {spec.tag!r}: its setup did not finish within {spec.setup_timeout:g} s "
                                  f"(setup_timeout_secs, start-up included) and was stopped")
            if got is not None and got[0].get("lost"):
                raise LossyFork(got[0]["lost"], f"snapshot {spec.tag!r}: every sandbox is a fork of it, and its setup")
            if limits or (got and got[0].get("setup_failed")):
                raise InvalidSpec(f"snapshot {spec.tag!r}: its setup failed: {detail}")
            raise EngineError(f"snapshot {spec.tag!r} failed to start: {detail}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            setup.boot.wait(timeout=30)  # it exits once the template runs
        os.unlink(log_path)
        # A lossy setup's template says what it left running (its children lack it): for the caller.
        lost = {"warnings": got[0]["warnings"]} if got[0].get("warnings") else {}
        return self._handle(got[1], path, role="template", cgroups=setup.done(), signal_guard=True, **lost)

    def _end_setup(self, setup: Setup, path: str, log_path: str) -> None:
        """A creation that failed, timed out or was cancelled: nothing of it stays."""
        with self._creating_lock:
            self._creating.pop(setup.tag, None)
        setup.end()
        _unlink(path)
        _unlink(log_path)

    def cancel(self, tag: str) -> bool:
        """Stop the creation of snapshot ``tag`` if it runs here: everything its setup started is
        killed; the creation then raises Cancelled."""
        with self._creating_lock:
            setup = self._creating.get(tag)
            if setup is None:
                return False
            setup.cancelled = True
        setup.stop()
        return True

    @staticmethod
    def _log_tail(path: str) -> str:
        with contextlib.suppress(OSError), open(path, "rb") as f:
            return f.read()[-2000:].decode("utf-8", "replace").strip() or "no output"
        return "no output"

    def delete_snapshot(self, handle: Handle) -> None:
        self._end(handle)
        self.cgroups.remove(handle.get("cgroups") or [])  # its init's go once its children are gone

    # --- sandboxes -------------------------------------------------------------------------------

    def spawn(self, snapshot: Handle, children: list[ChildSpec]) -> list[Handle]:
        handles: list[Handle] = []
        try:
            for i in range(0, len(children), SPAWN_BATCH):
                handles += self._spawn_batch(snapshot, children[i:i + SPAWN_BATCH])
        except BaseException:
            for h in handles:
                with contextlib.suppress(Exception):
                    self.kill(h)
            raise
        return handles

    def _spawn_batch(self, snapshot: Handle, batch: list[ChildSpec]) -> list[Handle]:
        ours, theirs = self._report_pair()
        listeners = [self._listen(c.id) for c in batch]
        paths = {c.id: p for c, (_, p) in zip(batch, listeners)}
        limits = {c.id: c.memory_limit_mib or self.default_memory_limit_mib for c in batch}
        request = {"action": "spawn", "children": [
            {"id": c.id, "lineage": c.lineage, **dict(zip(("tmp_size_mib", "shm_size_mib"), tmpfs_sizes(limits[c.id]))),
             # its leaves cap its huge pages at its memory limit: the compactor moves up to that
             "huge_pages_mib": limits[c.id] if self.huge_pages else 0}
            for c in batch]}
        # The children's cgroup leaves, with their limits, are made while the template forks them
        # (this thread only waits meanwhile); the children join them once all have reported, in one
        # go: a write to cgroup.procs waits for an RCU grace period unless another has just
        # been made (cgroup_threadgroup_rwsem), and holds up every fork on the host meanwhile.
        leaves: Future = Future()
        threading.Thread(target=self._prepare_leaves, args=(batch, limits, leaves), name="forkd-leaves",
                         daemon=True).start()
        started: dict[str, Handle] = {}
        try:
            reply = self.call(snapshot, request, timeout=self.spawn_timeout,
                              fds=[theirs.fileno()] + [s.fileno() for s, _ in listeners])
            theirs.close()
            for s, _ in listeners:
                s.close()
            if "error" in reply:
                raise _failure("spawn failed", reply["error"])
            deadline = time.monotonic() + self.spawn_timeout
            errors = []
            while len(started) + len(errors) < len(batch):
                got = self._read_report(ours, deadline)
                if got is None:
                    errors.append("a sandbox exited before reporting")
                    break
                msg, pid = got
                if msg.get("ok"):
                    started[msg["id"]] = self._handle(pid, paths[msg["id"]], role="sandbox", **_guarded(snapshot))
                else:
                    errors.append(f"{msg.get('id')}: {msg.get('error')}")
            if errors:
                raise _failure("spawn failed", "; ".join(errors[:3]))
            made = leaves.result(timeout=self.spawn_timeout)
            for cid, h in started.items():
                self._join_leaves(h, made[cid])
            return [started[c.id] for c in batch]
        except BaseException:
            for h in started.values():
                with contextlib.suppress(Exception):
                    self.kill(h)
            for path in paths.values():
                _unlink(path)
            with contextlib.suppress(Exception):  # those of children that never started
                for cid, made in leaves.result(timeout=self.spawn_timeout).items():
                    if cid not in started or "cgroups" not in started[cid]:
                        self.cgroups.remove(made)
            raise
        finally:
            ours.close()
            theirs.close()
            for s, _ in listeners:
                s.close()

    def _prepare_leaves(self, batch: list[ChildSpec], limits: dict[str, int], out: Future) -> None:
        """Make each child's leaves (memory, pids and huge-page limits), into ``out``: id -> paths."""
        made: dict[str, list[str]] = {}
        try:
            for c in batch:
                made[c.id] = self.cgroups.prepare(c.id, limits[c.id], self.pids_max)
        except (CgroupError, OSError) as exc:
            for paths in made.values():
                self.cgroups.remove(paths)
            out.set_exception(EngineError(str(exc)))
            return
        out.set_result(made)

    def _join_leaves(self, handle: Handle, leaves: list[str]) -> None:
        """Put a reported child and its init into their leaves; the handle then names them."""
        try:
            self.cgroups.join(leaves, [handle["init"]["pid"], handle["pid"]])
        except OSError as exc:
            raise EngineError(str(exc)) from exc
        handle["cgroups"] = leaves

    # --- freeze and thaw (the frozen tier) ---------------------------------------------------------

    def freeze(self, handle: Handle) -> None:
        """Freeze the sandbox: its v2 cgroup leaf's freezer where it has one (nothing inside can tell),
        else SIGSTOP to each of its processes (a stop its processes' parents may see)."""
        self._set_frozen(handle, True)

    def thaw(self, handle: Handle) -> None:
        self._set_frozen(handle, False)

    def _set_frozen(self, handle: Handle, frozen: bool) -> None:
        if not self.alive(handle):
            raise EngineError(f"process {handle['pid']} is gone")
        leaves = handle.get("cgroups") or []
        leaf = self.cgroups.freezer(leaves)
        try:
            if leaf is not None:
                self.cgroups.set_frozen(leaf, frozen)
                return
            pids = sorted({p for lf in leaves for p in self.cgroups.procs(lf)}) or \
                [p for p in ((handle.get("init") or {}).get("pid"), handle["pid"]) if p]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        except OSError as exc:
            raise EngineError(f"could not {'freeze' if frozen else 'thaw'} process {handle['pid']}: {exc}") from exc

    def kill(self, handle: Handle) -> None:
        if handle.get("cgroups") and self.alive(handle):
            with contextlib.suppress(EngineError):  # a frozen init could not reap its agent
                self._set_frozen(handle, False)
        self._end(handle)
        self.cgroups.remove(handle.get("cgroups") or [])  # its init's go once its last fork has

    def _end(self, handle: Handle) -> None:
        """End the agent with SIGKILL (what is nested in its pid namespace lives on: its init holds
        the namespace) and tell its init that its end is known, so the init goes once nothing nested
        in it lives. Also releases what we hold for an agent that ended by itself."""
        init = handle.get("init")
        if init is None:
            self._retire(handle)
            return
        if self.alive(handle):
            try:
                pidfd = os.pidfd_open(handle["pid"])
            except ProcessLookupError:
                pidfd = None
            if pidfd is not None:
                try:
                    if linux.process_start_time(handle["pid"]) == handle["start_time"]:
                        with contextlib.suppress(ProcessLookupError):
                            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                        if not linux.wait_pidfd(pidfd, KILL_WAIT):
                            raise EngineError(f"process {handle['pid']} did not exit within {KILL_WAIT:g} s of SIGKILL")
                finally:
                    os.close(pidfd)
        sandbox_init.collect(init["pid"], init["start_time"])
        if not sandbox_init.holds_forks(init["pid"]):
            # It goes at once (after its strays): wait, so a kill leaves nothing of the sandbox.
            if not linux.wait_exit(init["pid"], init["start_time"], KILL_WAIT) \
                    and not sandbox_init.holds_forks(init["pid"]):
                raise EngineError(f"the init {init['pid']} of process {handle['pid']} did not exit within "
                                  f"{KILL_WAIT:g} s of its agent's end")
        self._forget(handle)

    def _retire(self, handle: Handle) -> None:
        """The end of a handle without an init, made by a server before forkd-init, whose agent is
        PID 1 itself: ask it to retire (it turns into a reaper while forks of it live); force it
        only where that ends no fork."""
        if not self.alive(handle):
            self._forget(handle)
            return
        pid = handle["pid"]
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._forget(handle)
            return
        try:
            try:
                reply = self.call(handle, {"action": "retire"}, timeout=RETIRE_TIMEOUT)
            except AgentUnreachable:
                reply = {}
            if not reply.get("retired") and linux.live_children(pid):
                # No answer, and it has live forks: a SIGKILL of it (PID 1 of their pid namespace)
                # would end every one of them. It stays, to do the retire it may have received, or
                # as their ancestor; its leaves go once it has exited.
                self._forget(handle)
                return
            if reply.get("retired") != "reaper":
                if reply.get("retired") != "exit":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                # Wait for the exit itself: its pid namespace (and every process in it) is gone then.
                linux.wait_pidfd(pidfd, 10)
        finally:
            os.close(pidfd)
        self._forget(handle)

    def abandon(self, name: str) -> None:
        """End whatever an interrupted start left serving under ``name`` (the registry has no handle)."""
        path = self._socket_path(name)
        if os.path.exists(path):
            self._end_behind(path)

    def _forget(self, handle: Handle) -> None:
        """Release what we hold for a process we are done with: its socket and its pidfd."""
        _unlink(handle["socket"])
        with self._pidfd_lock:
            fd = self._pidfds.pop((handle.get("pid"), handle.get("start_time")), None)
        if fd is not None:
            os.close(fd)

    # --- branch ----------------------------------------------------------------------------------

    def branch(self, sandbox: Handle, tag: str, lineage: list[str], mode: str = "full",
               lossy: bool = False) -> BranchResult:
        # Every mode is the same copy-on-write fork(), at once: the source pauses only for the
        # page-table copy, which the sandbox keeps small while it idles (compactor.py, hugepages.py;
        # see docs/design/process-engine.md, "Branch modes").
        listener, path = self._listen("snap:" + tag)
        ours, theirs = self._report_pair()
        try:
            reply = self.call(sandbox, {"action": "branch", "id": tag, "lineage": lineage, "mode": mode,
                                        "lossy": bool(lossy)},
                              fds=[theirs.fileno(), listener.fileno()])
        except BaseException:
            ours.close()
            _unlink(path)
            raise
        finally:
            theirs.close()
            listener.close()
        if "error" in reply:
            ours.close()
            _unlink(path)
            if reply.get("lost"):
                raise LossyFork(reply["lost"], "this branch")
            raise _failure("branch failed", reply["error"])

        ready: Future = Future()

        def finish() -> None:
            leaves: list[str] = []
            started = None  # the new template's pidfd, once it has asked to be moved
            try:
                deadline = time.monotonic() + self.spawn_timeout
                got = self._read_report(ours, deadline)
                if got is not None and got[0].get("move"):
                    init = linux.parent_pid(got[1])  # its forkd-init, PID 1 of its pid namespace
                    with contextlib.suppress(OSError, TypeError):
                        started = os.pidfd_open(init)
                    # The new template asks for leaves of its own (for it and its init) before it
                    # copies /tmp and /dev/shm (charged to its source's limit otherwise); a
                    # snapshot's are unlimited.
                    try:
                        leaves = self.cgroups.move(leaf_name("branch", tag), [p for p in (init, got[1]) if p])
                    finally:
                        ours.send(b"moved")
                    got = self._read_report(ours, deadline)
                if got is None or not got[0].get("ok"):
                    raise _failure(f"branch {tag!r} failed", got[0].get("error") if got else "the new snapshot exited")
                ready.set_result(self._handle(got[1], path, role="template", cgroups=leaves, **_guarded(sandbox)))
            except BaseException as exc:  # noqa: BLE001
                _unlink(path)
                if started is not None:
                    # It may come up after all (its report past the deadline): no record would name
                    # it and nothing has forked from it, so it ends here, with its init's namespace.
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(started, signal.SIGKILL)
                    linux.wait_pidfd(started, 10)  # gone, so its leaves can go
                self.cgroups.remove(leaves)
                ready.set_exception(exc if isinstance(exc, EngineError) else EngineError(str(exc)))
            finally:
                ours.close()
                if started is not None:
                    os.close(started)

        threading.Thread(target=finish, name=f"branch-{tag}", daemon=True).start()
        return BranchResult(pause_ms=float(reply["pause_ms"]), ready=ready,
                            prepare_ms=float(reply.get("prepare_ms", 0.0)), warnings=list(reply.get("warnings") or []))

    def inventory(self, handle: Handle) -> list[str]:
        """What a branch of this sandbox now would not carry (threads, processes, sockets...)."""
        reply = self.call(handle, {"action": "inventory"}, timeout=10)
        if "error" in reply:
            raise EngineError(f"inventory failed: {reply['error']}")
        return list(reply.get("lost") or [])

    def close(self) -> None:
        """Templates and sandboxes outlive the server by design: only our watchers are closed, and
        our cgroup leaves and group removed where empty."""
        self.kept.close()
        with self._pidfd_lock:
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()
        if self.huge_page_reserve is not None:
            self.huge_page_reserve.close()
        self.cgroups.close()
