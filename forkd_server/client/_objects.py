"""The E2B-like surface over the controllers: ``Sandbox`` and ``Snapshot`` (over ``Controller``),
``AsyncSandbox`` and ``AsyncSnapshot`` (over ``AsyncController``), and what their calls return
(``Execution``, ``CommandResult``).

Each method is written once, in ``_SandboxCalls``/``_SnapshotCalls``: a call of the controller, or
a generator of steps (``_core``) handed to the controller's ``_do``; the sync classes get results,
the async ones awaitables of the same results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import _cells
from ._controller import AsyncController, Controller
from ._core import Close, OpenSession, consume, notify
from ._errors import ControllerError

__all__ = ["AsyncSandbox", "AsyncSnapshot", "CommandResult", "Execution", "Sandbox", "Snapshot"]


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    error: str | None = None


@dataclass
class Execution:
    """The result of ``run_code``: like a notebook cell's outputs."""

    stdout: str = ""
    stderr: str = ""
    results: list[dict] = field(default_factory=list)   # display_data / execute_result mime bundles
    result: dict | None = None                           # the last expression's mime bundle
    error: dict | None = None                            # {"ename", "evalue", "traceback"}

    @property
    def text(self) -> str | None:
        return (self.result or {}).get("text/plain")


def _command_result(r: dict) -> CommandResult:
    return CommandResult(r.get("stdout", ""), r.get("stderr", ""), r.get("exit_code", 1), r.get("error"))


def _eval_result(reply: dict) -> str:
    if reply.get("error"):
        raise RuntimeError(f"forkd eval: {reply['error']}")
    return reply.get("result")


class _Commands:
    def __init__(self, sb: "_SandboxCalls"):
        self._sb = sb

    def run(self, cmd: str | list[str], timeout: float = 30, *, env: dict | None = None,
            cwd: str | None = None) -> CommandResult:
        """Run a command (a str goes through ``/bin/sh -c``). A non-zero exit does not raise."""
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        ctl = self._sb.controller
        return ctl._do(ctl.plan.exec_command(self._sb.id, args, timeout, env=env, cwd=cwd), then=_command_result)


class _Files:
    def __init__(self, sb: "_SandboxCalls"):
        self._sb = sb

    def read(self, path: str, format: str = "text") -> str | bytes:  # noqa: A002 - E2B's name
        ctl = self._sb.controller
        return ctl._do(ctl.plan.read_file(self._sb.id, path),
                       then=lambda data: data.decode() if format == "text" else data)

    def write(self, path: str, data: str | bytes, *, append: bool = False) -> dict:
        return self._sb.controller.write_file(self._sb.id, path, data, append=append)

    def list(self, path: str = ".") -> list[dict]:
        return self._sb.controller.list_files(self._sb.id, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        return self._sb.controller.remove_file(self._sb.id, path, recursive=recursive)

    def exists(self, path: str) -> bool:
        return self._sb.controller._do(self._exists(path))

    def _exists(self, path: str):
        try:
            yield self._sb.controller.request("GET", f"/v1/sandboxes/{self._sb.id}/files", query={"path": path})
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True


class _SandboxCalls:
    """A running sandbox's calls, written once (see the module's docstring)."""

    _Controller: type
    _Snapshot: type
    controller: Controller | AsyncController
    info: dict

    def _setup(self, info: dict, controller) -> None:
        self.controller, self.info = controller, dict(info)
        self.commands = _Commands(self)
        self.files = _Files(self)

    @classmethod
    def create(cls, snapshot_tag: str, *, controller=None, **spawn_options):
        """A new sandbox from snapshot ``snapshot_tag`` (``spawn_options`` as ``spawn_sandboxes``)."""
        controller = controller or cls._Controller()
        return controller._do(controller.plan.spawn_sandboxes(snapshot_tag, 1, **spawn_options),
                              then=lambda infos: cls(infos[0], controller))

    @classmethod
    def connect(cls, sandbox_id: str, controller=None):
        """The running sandbox ``sandbox_id``."""
        controller = controller or cls._Controller()
        return controller._do(controller.plan.get_sandbox(sandbox_id), then=lambda info: cls(info, controller))

    @classmethod
    def list(cls, controller=None, *, labels: dict[str, str] | None = None):
        controller = controller or cls._Controller()
        return controller._do(controller.plan.list_sandboxes(labels=labels),
                              then=lambda infos: [cls(i, controller) for i in infos])

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def snapshot_tag(self) -> str:
        return self.info["snapshot_tag"]

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.info.get("labels") or {})

    @property
    def fork_tree_id(self) -> str | None:
        """The open fork tree this sandbox is a child of (``fork``), else None (a promote closes it)."""
        return self.labels.get("fork_tree_id")

    def __repr__(self) -> str:
        tree = f", fork_tree_id={self.fork_tree_id!r}" if self.fork_tree_id else ""
        return f"{type(self).__name__}({self.id!r}, snapshot_tag={self.snapshot_tag!r}{tree})"

    @property
    def tier(self) -> str:
        """``running``, ``frozen`` or ``stored``, as of the last answer about this sandbox
        (``refresh()`` asks again)."""
        return self.info.get("tier") or "running"

    def refresh(self):
        """Ask the server for this sandbox's info again (its tier, labels...); returns self."""
        return self.controller._do(self.controller.plan.get_sandbox(self.id), then=self._took)

    def freeze(self):
        """Pause it, its memory kept and no CPU used; the next call wakes it. Returns self."""
        return self.controller._do(self.controller.plan.freeze_sandbox(self.id), then=self._took)

    def store(self):
        """Write its state to the store and end its process (VM engine; the process engine's
        deepest tier is frozen: a 409). The next call wakes it, same id. Returns self."""
        return self.controller._do(self.controller.plan.store_sandbox(self.id), then=self._took)

    def wake(self) -> dict:
        """Make it running again now; returns the wake's figures (``ms``; from stored also
        ``fetch_ms``, ``decompress_ms``, ``restore_ms``)."""
        def took(info: dict) -> dict:
            self._took(info)
            return info.get("wake") or {}
        return self.controller._do(self.controller.plan.wake_sandbox(self.id), then=took)

    def _took(self, info: dict):
        self.info = {k: v for k, v in info.items() if k != "wake"}
        return self

    def ping(self) -> dict:
        return self.controller.ping_sandbox(self.id)

    def eval(self, code: str) -> str:
        """Evaluate one expression in the sandbox's persistent namespace; returns its repr."""
        return self.controller._do(self.controller.plan.eval_code(self.id, code), then=_eval_result)

    def run_stream(self, code: str, timeout: float | None = None):
        """Run a cell and yield its events as they happen (``stream``, ``display_data``,
        ``error``...); the last is the ``execute_reply``. ``for event in sb.run_stream(...)`` (async:
        ``async for``). After ``timeout`` seconds the cell is interrupted; leaving the loop early,
        or cancelling the task that iterates it, interrupts it too."""
        return self.controller._stream(self._run_stream(code, timeout))

    def _run_stream(self, code: str, timeout: float | None):
        session = yield OpenSession(self.id)
        try:
            return (yield from _cells.stream(session, code, timeout, store_history=False))
        finally:
            yield Close(session)

    def stream_code(self, code: str):
        """``run_stream`` without a timeout (its name in earlier versions)."""
        return self.run_stream(code)

    def run_code(self, code: str, timeout: float | None = None, *, on_event: Callable | None = None,
                 on_stdout: Callable[[str], object] | None = None,
                 on_stderr: Callable[[str], object] | None = None) -> Execution:
        """Run a cell (``run_stream``, collected): ``on_stdout(text)``/``on_stderr(text)`` see its
        output as it is printed, ``on_event(event)`` every event (``{"type": "stream", "name":
        "stdout", "text": ...}``, ``display_data``, ``error``...); on the async SDK they may be
        ``async def``. After ``timeout`` seconds the cell is interrupted; so it is if the caller
        gives up (Ctrl-C, a cancelled task)."""
        return self.controller._do(self._run_code(code, timeout, on_event, on_stdout, on_stderr))

    def _run_code(self, code, timeout, on_event, on_stdout, on_stderr):
        execution = Execution()
        out: list[str] = []
        err: list[str] = []

        def collect(event: dict):
            kind = event.get("type")
            if kind == "execute_reply":
                return
            if kind == "stream":
                text = event.get("text", "")
                stdout = event.get("name") == "stdout"
                (out if stdout else err).append(text)
                yield from notify(on_stdout if stdout else on_stderr, text)
            elif kind in ("display_data", "execute_result", "update_display_data"):
                execution.results.append({"type": kind, "data": event.get("data", {})})
                if kind == "execute_result":
                    execution.result = event.get("data")
            elif kind == "error":
                execution.error = {k: event.get(k) for k in ("ename", "evalue", "traceback")}
            yield from notify(on_event, event)

        reply = yield from consume(self._run_stream(code, timeout), collect)
        if reply.get("status") == "error" and execution.error is None:
            execution.error = {k: reply.get(k) for k in ("ename", "evalue", "traceback")}
        execution.stdout, execution.stderr = "".join(out), "".join(err)
        return execution

    def session(self, shell: str = "plain"):
        """A streaming session with this sandbox (see ``Controller.session``)."""
        return self.controller.session(self.id, shell=shell)

    def interrupt(self) -> dict:
        return self.controller.interrupt(self.id)

    def branch(self, tag: str | None = None, *, mode: str | None = None, wait: bool = True,
               lossy: bool = False, labels: dict[str, str] | None = None):
        """Turn this running sandbox into a new snapshot (it keeps running). ``lossy``: fork even if
        running work stays behind (a ForkWarning and ``Snapshot.warnings`` list it). ``labels``
        update the ones it inherits from this sandbox."""
        ctl = self.controller
        return ctl._do(ctl.plan.branch_sandbox(self.id, tag, mode=mode, wait=wait, lossy=lossy, labels=labels),
                       then=lambda info: self._Snapshot(info, ctl))

    def fork(self, count: int = 1, *, tag: str | None = None, labels: dict[str, str] | None = None,
             memory_limit_mib: int | str | None = None, lossy: bool = False):
        """``count`` copies of this sandbox as it is now, one fork tree: it is branched once and the
        children spawned from that branch, each with the tree's ``fork_tree_id``. Run something in
        each, then ``winner.promote()`` keeps one and kills the rest."""
        ctl = self.controller
        return ctl._do(ctl.plan.fork_sandbox(self.id, count, tag=tag, labels=labels,
                                             memory_limit_mib=memory_limit_mib, lossy=lossy),
                       then=lambda tree: [type(self)(i, ctl) for i in tree["sandboxes"]])

    def promote(self, cleanup_siblings: bool = True, *, tree_id: str | None = None) -> dict:
        """This sandbox wins its fork tree: its siblings are killed (``cleanup_siblings``) and the
        tree's snapshot is released if nothing needs it; what another notebook, a workspace or a tag
        holds stays (``kept`` says why). Returns ``{"fork_tree_id", "winner", "killed", "released",
        "kept", "failed"}``; this object's ``info`` becomes the winner's."""
        return self.controller._do(self._promote(cleanup_siblings, tree_id or self.fork_tree_id))

    def _promote(self, cleanup_siblings: bool, tree_id: str | None):
        result = yield from self.controller.plan.promote_sandbox(self.id, tree_id, cleanup_siblings=cleanup_siblings)
        self.info = dict(result["winner"])
        return result

    def inventory(self) -> list[str]:
        """What a branch now would not carry (always [] on the VM engine)."""
        return self.controller._do(self.controller.plan.inventory(self.id), then=lambda reply: reply["lost"])

    def memory(self) -> dict:
        return self.controller.memory(self.id)

    def kill(self, *, reason: str | None = None) -> None:
        """Kill the sandbox (one already gone is no error); ``reason``: why, as its 404 says it."""
        return self.controller._do(self._kill(reason))

    def _kill(self, reason: str | None = None):
        try:
            yield from self.controller.plan.kill_sandbox(self.id, reason=reason)
        except ControllerError as exc:
            if exc.status != 404:
                raise


class _SnapshotCalls:
    """A snapshot's calls, written once (see the module's docstring)."""

    _Controller: type
    _Sandbox: type
    controller: Controller | AsyncController
    info: dict

    @classmethod
    def create(cls, tag: str, *, controller=None, **options):
        """A new snapshot (``options`` as ``Controller.create_snapshot``: ``setup``, ``packages``...)."""
        controller = controller or cls._Controller()
        return controller._do(controller.plan.create_snapshot(tag, **options), then=lambda info: cls(info, controller))

    @classmethod
    def connect(cls, tag: str, controller=None):
        """The snapshot ``tag``."""
        controller = controller or cls._Controller()
        return controller._do(cls._lookup(tag, controller), then=lambda info: cls(info, controller))

    @staticmethod
    def _lookup(tag: str, controller):
        snapshots = yield from controller.plan.list_snapshots()
        info = next((s for s in snapshots if s["tag"] == tag), None)
        return info or (yield from controller.plan.snapshot_info(tag))

    @property
    def tag(self) -> str:
        return self.info["tag"]

    @property
    def status(self) -> str:
        return self.info.get("status", "ready")

    @property
    def pause_ms(self) -> int | None:
        """How long the branch paused its source, in whole milliseconds rounded up (forkd's type)."""
        return self.info.get("pause_ms")

    @property
    def pause_us(self) -> int | None:
        """The same pause in microseconds: the precise figure."""
        return self.info.get("pause_us")

    @property
    def branched_from(self) -> str | None:
        return self.info.get("branched_from")

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.info.get("labels") or {})

    @property
    def warnings(self) -> list[str]:
        """What a lossy branch did not carry ([] for a complete copy)."""
        return list(self.info.get("warnings") or [])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tag!r}, status={self.status!r})"

    def wait(self, timeout: float = 120.0):
        """Wait until the snapshot is ``ready`` (or ``failed``: raises); returns it."""
        return self.controller._do(self._wait(timeout))

    def _wait(self, timeout: float):
        self.info = yield from self.controller.plan.wait_snapshot(self.tag, timeout)
        if self.status == "failed":
            raise RuntimeError(f"snapshot {self.tag} failed: {self.info.get('warning', '')}")
        return self

    def fork(self, n: int = 1, **spawn_options):
        """``n`` new sandboxes from this snapshot (waiting first if it is still being written)."""
        return self.controller._do(self._fork(n, spawn_options))

    def _fork(self, n: int, spawn_options: dict):
        if self.status == "writing":
            yield from self._wait(120.0)
        infos = yield from self.controller.plan.spawn_sandboxes(self.tag, n, **spawn_options)
        return [self._Sandbox(i, self.controller) for i in infos]

    def details(self) -> dict:
        return self.controller.snapshot_info(self.tag)

    def delete(self, *, cascade: bool = False, force: bool = False) -> None:
        return self.controller.delete_snapshot(self.tag, cascade=cascade, force=force)


class Sandbox(_SandboxCalls):
    """A running sandbox. ``with Sandbox.create("py") as sb:`` kills it on exit."""

    _Controller = Controller

    def __init__(self, info: dict | str, controller: Controller | None = None):
        controller = controller or Controller()
        self._setup(controller.get_sandbox(info) if isinstance(info, str) else info, controller)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class Snapshot(_SnapshotCalls):
    """A snapshot (a frozen, warmed-up interpreter); ``fork(n)`` makes sandboxes from it."""

    _Controller = Controller
    _Sandbox = Sandbox

    def __init__(self, info: dict | str, controller: Controller | None = None):
        self.controller = controller or Controller()
        self.info = dict(self.controller._do(self._lookup(info, self.controller)) if isinstance(info, str) else info)


class AsyncSandbox(_SandboxCalls):
    """A running sandbox, for asyncio: ``sb = await AsyncSandbox.create("py")``; every call is
    awaited; ``async with`` kills it on exit; ``async for event in sb.run_stream(code)``."""

    _Controller = AsyncController

    def __init__(self, info: dict, controller: AsyncController | None = None):
        if isinstance(info, str):
            raise TypeError(f"AsyncSandbox({info!r}): to attach to a running sandbox by its id, "
                            f"`await AsyncSandbox.connect({info!r})`")
        self._setup(info, controller or AsyncController())

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kill()


class AsyncSnapshot(_SnapshotCalls):
    """A snapshot, for asyncio: ``snap = await AsyncSnapshot.create("py", setup=...)``,
    ``kids = await snap.fork(3)`` (``AsyncSandbox`` objects)."""

    _Controller = AsyncController
    _Sandbox = AsyncSandbox

    def __init__(self, info: dict, controller: AsyncController | None = None):
        if isinstance(info, str):
            raise TypeError(f"AsyncSnapshot({info!r}): to look a snapshot up by its tag, "
                            f"`await AsyncSnapshot.connect({info!r})`")
        self.controller = controller or AsyncController()
        self.info = dict(info)


Sandbox._Snapshot, AsyncSandbox._Snapshot = Snapshot, AsyncSnapshot
