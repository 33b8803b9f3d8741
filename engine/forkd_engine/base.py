"""The engine contract: what the controller may ask of any sandbox engine.

An engine makes snapshots, spawns copy-on-write sandboxes from them, branches a running sandbox
into a new snapshot, talks to the agent inside, and kills or deletes. Every live object is named by
a *handle*: a small JSON-serializable dict the controller stores, so that after a restart it can
hand the handle back and the engine re-attaches (``alive``) without keeping state of its own.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

Handle = dict


class EngineError(Exception):
    """The engine could not do what was asked; the message says why and what to do."""


class EngineUnavailable(EngineError):
    """This host cannot run the engine at all (missing privilege, device or binary)."""


class AgentUnreachable(EngineError):
    """The sandbox's agent did not answer."""


PROBE_PARALLELISM = 32  # agents pinged at once by an engine's probe()


def ping_problem(call: Callable[[dict], dict]) -> str | None:
    """Why an agent fails a ping sent through ``call`` (None: it answers pong), for ``probe``."""
    try:
        reply = call({"action": "ping"})
    except AgentUnreachable as exc:
        return f"its agent does not answer ({exc})"
    return None if reply.get("pong") is True else f"its agent answered a ping with {reply!r:.200}"


class InvalidSpec(EngineError):
    """The request names something that cannot exist as given (e.g. an unknown Debian package): the
    caller's mistake, answered as such, not an engine failure."""


class Cancelled(EngineError):
    """The request was cancelled while it ran (a snapshot deleted while it was being created)."""


class LossyFork(EngineError):
    """A fork would silently leave behind running work it cannot carry (threads, child processes,
    an event loop's tasks, shared sockets...). ``items`` names each, one line a thing; the caller
    may retry with ``lossy=True`` to fork anyway (each item then becomes a warning) or use an engine
    that carries them (the VM engine copies the whole machine)."""

    def __init__(self, items: list[str], what: str = "a fork"):
        self.items = list(items)
        super().__init__(f"{what} would lose what a fork() cannot carry: " + "; ".join(self.items))


class LimitReached(EngineError):
    """A limit of this engine or host stops the request (e.g. how deeply process sandboxes can
    nest): the user's request cannot be served as asked, which the message explains with the way
    out. Not a failure of the engine."""


class UnsupportedMode(EngineError):
    """The request is valid but this host or engine cannot do it (e.g. a branch mode); the message
    names the reason. Never silently downgraded to something else."""


@dataclass
class SnapshotSpec:
    tag: str
    setup: str | None = None                       # Python run in the agent's persistent namespace
    setup_commands: list[list[str]] = field(default_factory=list)
    host_network: bool = False                     # default: loopback only
    mem_size_mib: int | None = None                # a VM's RAM; the process engine ignores it
    disk_mib: int | None = None                    # a VM's ext4 data disk at /data; process ignores it
    # Debian packages (and their dependencies) added to a VM's guest on a read-only disk, e.g.
    # ["python3-numpy"]; the process engine ignores it (its sandboxes see the host's files).
    packages: list[str] = field(default_factory=list)
    setup_timeout: float = 600.0                   # seconds for the whole creation, start-up included
    # The setup's memory limit (process engine; None: the engine's default). Its pids limit is
    # a sandbox's too, and both are lifted once setup is done (the template only forks).
    memory_limit_mib: int | None = None
    # Fork children even though setup left running work they cannot carry (else LossyFork).
    lossy: bool = False
    # "ipython": the snapshot holds a warmed IPython shell (the forkd kernel's); setup runs in it.
    shell: str = "plain"


@dataclass
class ChildSpec:
    id: str
    lineage: list[str] = field(default_factory=list)
    memory_limit_mib: int | None = None
    # The same sandbox woken from its stored state (tiers), not a copy: no fork hygiene (its
    # generators keep their streams, its identity stays), only its clock is stepped. VM engine.
    wake: bool = False


@dataclass(frozen=True)
class LimitHit:
    """A limit the kernel enforced on a sandbox: read from its cgroup's counters, which say that it
    happened (and how often), not to which process."""
    limit: str    # "memory", "huge_pages" or "pids"
    value: int    # the limit: MiB for memory and huge pages, processes and threads for pids
    count: int    # times it was enforced: OOM kills, huge pages refused, forks refused
    message: str  # the fact, said for a user


@dataclass(frozen=True)
class ExitStatus:
    """How a sandbox's (or template's) process ended, where its engine can tell: an exit status,
    or the signal that ended it (9 for a kill -9 and for the OOM killer alike), or what else the
    engine saw, said for a user (a VM guest kernel's panic)."""
    code: int | None = None
    signal: int | None = None
    note: str | None = None


@dataclass
class BranchResult:
    pause_ms: float  # how long the source was frozen
    ready: Future    # resolves to the new snapshot's handle, or raises EngineError
    prepare_ms: float = 0.0  # work done before the freeze while the source kept running
    # What the new snapshot does not carry (a lossy branch on the process engine), one line each.
    warnings: list[str] = field(default_factory=list)


class Session(Protocol):
    """A streaming conversation with a sandbox's agent: line-JSON messages both ways (execute,
    complete, interrupt, input_reply, comm_msg... in; stream, display_data, execute_reply... out)."""

    def send(self, message: dict) -> None: ...
    def recv(self, timeout: float | None = None) -> dict | None: ...  # None: the session has ended
    def close(self) -> None: ...


class Engine(Protocol):
    name: str

    # The handle may carry "warnings": what a lossy setup left running that its children lack
    # (the caller takes them out of the handle and keeps them with the snapshot).
    def create_snapshot(self, spec: SnapshotSpec) -> Handle: ...
    # Stop a create_snapshot(tag) running in this engine (it then raises Cancelled); False if none.
    def cancel(self, tag: str) -> bool: ...
    def spawn(self, snapshot: Handle, children: list[ChildSpec]) -> list[Handle]: ...
    def branch(self, sandbox: Handle, tag: str, lineage: list[str], mode: str,
               lossy: bool = False) -> BranchResult: ...
    def inventory(self, handle: Handle) -> list[str]: ...  # what a branch now would not carry
    def open_session(self, handle: Handle) -> Session: ...
    def call(self, handle: Handle, request: dict, timeout: float | None = None) -> dict: ...
    def kill(self, handle: Handle) -> None: ...
    def delete_snapshot(self, handle: Handle) -> None: ...
    def alive(self, handle: Handle) -> bool: ...
    # Wait up to ``timeout`` seconds for a sandbox's process to exit; True once it has.
    def wait_exit(self, handle: Handle, timeout: float) -> bool: ...
    # The limits the kernel enforced on a sandbox (its cgroup's counters), so a sandbox that died
    # of one can say so; read before ``kill``, which removes them.
    def limits_hit(self, handle: Handle) -> list[LimitHit]: ...
    # Raise a running sandbox's memory limit (and huge-page cap) to ``memory_mib``; never lowers it.
    def raise_memory_limit(self, handle: Handle, memory_mib: int) -> None: ...
    # How a sandbox's process ended, as its engine saw it (an exit status or signal, a guest kernel's
    # panic); None when unknown or while it runs. Read before ``kill`` too.
    def exit_status(self, handle: Handle) -> ExitStatus | None: ...
    # Why each handle does not answer its agent within ``timeout`` (None: it lives and answers);
    # all asked at once. A restarted server re-attaches only to what answers.
    def probe(self, handles: list[Handle], timeout: float) -> list[str | None]: ...
    # At start-up, before ``probe`` of the same handle: put right what only the engine can see is
    # wrong with it (e.g. a VM a live branch left frozen). Returns one line per thing done.
    def repair(self, handle: Handle) -> list[str]: ...
    # What a user should know of a recorded snapshot that only its handle says (made by an older
    # version, without a protection a snapshot made now has): one line each, kept with the snapshot.
    def snapshot_warnings(self, handle: Handle) -> list[str]: ...
    # At start-up, after every recorded object is settled: end and remove what no known handle names
    # (agents behind unknown sockets, files, VM processes) and that predates the engine. ``known``:
    # every handle the caller recorded. Returns one line per thing found and what was done.
    def recover(self, known: list[Handle]) -> list[str]: ...
    def abandon(self, name: str) -> None: ...
    # What the engine needs soon but a server's start need not wait for (imports, host probes):
    # called once, on a thread of its own, when the server's port listens.
    def warm_up(self) -> None: ...
    def memory(self, handle: Handle) -> dict: ...
    # Pause every process (or vCPU) of a running sandbox, its state kept and no CPU used (the
    # ``frozen`` tier), and let it go on; its agent does not answer while it is frozen.
    def freeze(self, handle: Handle) -> None: ...
    def thaw(self, handle: Handle) -> None: ...
    def close(self) -> None: ...
