"""The E2B-like surface over ``Controller``: ``Sandbox`` and ``Snapshot`` objects, and what their
calls return (``Execution``, ``CommandResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._controller import Controller
from ._transport import ControllerError

__all__ = ["CommandResult", "Execution", "Sandbox", "Snapshot"]

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


class _Commands:
    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def run(self, cmd: str | list[str], timeout: float = 30, *, env: dict | None = None,
            cwd: str | None = None) -> CommandResult:
        """Run a command (a str goes through ``/bin/sh -c``). A non-zero exit does not raise."""
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        r = self._sb.controller.exec_command(self._sb.id, args, timeout, env=env, cwd=cwd)
        return CommandResult(r.get("stdout", ""), r.get("stderr", ""), r.get("exit_code", 1), r.get("error"))


class _Files:
    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def read(self, path: str, format: str = "text") -> str | bytes:  # noqa: A002 - E2B's name
        data = self._sb.controller.read_file(self._sb.id, path)
        return data.decode() if format == "text" else data

    def write(self, path: str, data: str | bytes, *, append: bool = False) -> dict:
        return self._sb.controller.write_file(self._sb.id, path, data, append=append)

    def list(self, path: str = ".") -> list[dict]:
        return self._sb.controller.list_files(self._sb.id, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._sb.controller.remove_file(self._sb.id, path, recursive=recursive)

    def exists(self, path: str) -> bool:
        try:
            self._sb.controller._request("GET", f"/v1/sandboxes/{self._sb.id}/files", query={"path": path})
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True


class Sandbox:
    """A running sandbox. ``with Sandbox.create("py") as sb:`` kills it on exit."""

    def __init__(self, info: dict | str, controller: Controller | None = None):
        self.controller = controller or Controller()
        self.info = self.controller.get_sandbox(info) if isinstance(info, str) else dict(info)
        self.commands = _Commands(self)
        self.files = _Files(self)

    @classmethod
    def create(cls, snapshot_tag: str, *, controller: Controller | None = None, **spawn_options) -> "Sandbox":
        controller = controller or Controller()
        return cls(controller.spawn_sandboxes(snapshot_tag, 1, **spawn_options)[0], controller)

    @classmethod
    def connect(cls, sandbox_id: str, controller: Controller | None = None) -> "Sandbox":
        return cls(sandbox_id, controller)

    @classmethod
    def list(cls, controller: Controller | None = None, *, labels: dict[str, str] | None = None) -> list["Sandbox"]:
        controller = controller or Controller()
        return [cls(i, controller) for i in controller.list_sandboxes(labels=labels)]

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def snapshot_tag(self) -> str:
        return self.info["snapshot_tag"]

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.info.get("labels") or {})

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, snapshot_tag={self.snapshot_tag!r})"

    def ping(self) -> dict:
        return self.controller.ping_sandbox(self.id)

    def eval(self, code: str) -> str:
        """Evaluate one expression in the sandbox's persistent namespace; returns its repr."""
        reply = self.controller.eval_code(self.id, code)
        if reply.get("error"):
            raise RuntimeError(f"forkd eval: {reply['error']}")
        return reply.get("result")

    def run_code(self, code: str, timeout: float | None = None, *, on_event=None) -> Execution:
        """Run a cell through a streaming session: ``on_event(event)`` sees its output as it happens
        (``{"type": "stream", "name": "stdout", "text": ...}``, ``display_data``, ``error``...).
        After ``timeout`` seconds the cell is interrupted."""
        out: list[str] = []
        err: list[str] = []
        execution = Execution()

        def collect(event: dict) -> None:
            kind = event.get("type")
            if kind == "stream":
                (out if event.get("name") == "stdout" else err).append(event.get("text", ""))
            elif kind in ("display_data", "execute_result", "update_display_data"):
                execution.results.append({"type": kind, "data": event.get("data", {})})
                if kind == "execute_result":
                    execution.result = event.get("data")
            elif kind == "error":
                execution.error = {k: event.get(k) for k in ("ename", "evalue", "traceback")}
            if on_event is not None:
                on_event(event)

        with self.session() as session:
            reply = session.execute(code, on_event=collect, timeout=timeout, store_history=False)
        if reply.get("status") == "error" and execution.error is None:
            execution.error = {k: reply.get(k) for k in ("ename", "evalue", "traceback")}
        execution.stdout, execution.stderr = "".join(out), "".join(err)
        return execution

    def stream_code(self, code: str):
        """Run a cell and yield its events as they happen (``stream``, ``display_data``, ``error``...);
        the last is the ``execute_reply``. ``for event in sb.stream_code("...")``: print as it runs."""
        with self.session() as session:
            yield from session.stream(code, store_history=False)

    def session(self, shell: str = "plain"):
        """A streaming session with this sandbox (see ``Controller.session``)."""
        return self.controller.session(self.id, shell=shell)

    def interrupt(self) -> dict:
        return self.controller.interrupt(self.id)

    def branch(self, tag: str | None = None, *, mode: str | None = None, wait: bool = True,
               lossy: bool = False, labels: dict[str, str] | None = None) -> "Snapshot":
        """Turn this running sandbox into a new snapshot (it keeps running). ``lossy``: fork even if
        running work stays behind (a ForkWarning and ``Snapshot.warnings`` list it). ``labels``
        update the ones it inherits from this sandbox."""
        return Snapshot(self.controller.branch_sandbox(self.id, tag, mode=mode, wait=wait, lossy=lossy,
                                                       labels=labels), self.controller)

    def inventory(self) -> list[str]:
        """What a branch now would not carry (always [] on the VM engine)."""
        return self.controller.inventory(self.id)["lost"]

    def memory(self) -> dict:
        return self.controller.memory(self.id)

    def kill(self) -> None:
        try:
            self.controller.kill_sandbox(self.id)
        except ControllerError as exc:
            if exc.status != 404:
                raise

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class Snapshot:
    """A snapshot (a frozen, warmed-up interpreter); ``fork(n)`` makes sandboxes from it."""

    def __init__(self, info: dict | str, controller: Controller | None = None):
        self.controller = controller or Controller()
        if isinstance(info, str):
            info = next((s for s in self.controller.list_snapshots() if s["tag"] == info), None) or \
                self.controller.snapshot_info(info)
        self.info = dict(info)

    @classmethod
    def create(cls, tag: str, *, controller: Controller | None = None, **options) -> "Snapshot":
        controller = controller or Controller()
        return cls(controller.create_snapshot(tag, **options), controller)

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
        return f"Snapshot({self.tag!r}, status={self.status!r})"

    def wait(self, timeout: float = 120.0) -> "Snapshot":
        """Wait until the snapshot is ``ready`` (or ``failed``: raises)."""
        self.info = self.controller.wait_snapshot(self.tag, timeout)
        if self.status == "failed":
            raise RuntimeError(f"snapshot {self.tag} failed: {self.info.get('warning', '')}")
        return self

    def fork(self, n: int = 1, **spawn_options) -> list[Sandbox]:
        if self.status == "writing":
            self.wait()
        return [Sandbox(i, self.controller) for i in self.controller.spawn_sandboxes(self.tag, n, **spawn_options)]

    def details(self) -> dict:
        return self.controller.snapshot_info(self.tag)

    def delete(self, *, cascade: bool = False, force: bool = False) -> None:
        self.controller.delete_snapshot(self.tag, cascade=cascade, force=force)
