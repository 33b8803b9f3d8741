"""The controller: forkd's v1 policy, independent of HTTP.

It validates requests in forkd's documented check order, owns tags, lineage and the branch
concurrency cap, records every change in the registry before and after the engine acts, and
re-attaches to live templates and sandboxes when it starts. Handlers and front ends call it; it
calls an engine; neither knows of the other.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from forkd_engine import AgentUnreachable, ChildSpec, EngineError, InvalidSpec, LossyFork, SnapshotSpec, UnsupportedMode

from .errors import BadRequest, Busy, Conflict, EngineFailure, ForkdError, NotFound
from .registry import Registry

TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")
MAX_CHILDREN = 1000
BRANCH_MODES = ("full", "diff", "live")
ENGINES = ("auto", "process", "vm")
# A workspace's state snapshot is ``ws-<name>-state`` (forkd's name); it must itself be a valid tag.
WORKSPACE_NAME_MAX = 64 - len("ws--state")



def default_data_dir() -> str:
    """``$FORKD_DATA_DIR``, else ``$XDG_DATA_HOME/forkd``, else ``~/.local/share/forkd``."""
    return os.environ.get("FORKD_DATA_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "forkd")


def check_tag(tag, what: str = "tag") -> str:
    if not isinstance(tag, str) or not TAG_RE.match(tag):
        raise BadRequest(f"invalid {what} {tag!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, "
                         f"not starting with '.' or '-'")
    return tag


def lossy_refusal(exc: LossyFork, what: str) -> Conflict:
    """409: what a fork would lose, and the two ways out."""
    items = "".join(f"\n  - {item}" for item in exc.items)
    return Conflict(f"{what} would lose what a fork() cannot carry:{items}\nPass \"lossy\": true to fork anyway "
                    f"(the snapshot then carries these as warnings), or use the VM engine (engine \"vm\"), "
                    f"which copies the whole machine: threads, processes and sockets included")


def _int_field(value, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise BadRequest(f"{name} must be between {lo} and {hi}" if hi else f"{name} must be at least {lo}")
    return value


class Controller:
    def __init__(self, data_dir: str, engines: dict | None = None, *, branch_concurrency: int = 4,
                 default_engine: str = "auto"):
        if branch_concurrency < 1:
            raise ValueError("branch_concurrency must be at least 1")
        self.data_dir = os.path.realpath(data_dir)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.registry = Registry(os.path.join(self.data_dir, "registry.sqlite3"))
        self.unavailable: dict[str, str] = {}  # engine name -> why this host cannot run it
        self.engines = dict(engines) if engines is not None else self._default_engines()
        self.default_engine = default_engine
        self.branch_cap = branch_concurrency
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()     # tags being written (create or branch)
        self._branches = 0                    # branches holding a concurrency slot
        self._ws_busy: dict[str, str] = {}    # workspace name -> the operation holding it
        self._changed = threading.Condition()
        self._listeners: list[Callable[[dict], None]] = []
        self._listing: tuple | None = None    # (registry generation, running rows, their infos)
        self.reconcile()

    def _default_engines(self) -> dict:
        from forkd_engine import EngineUnavailable
        from forkd_engine.process import ProcessEngine

        engines = {}
        try:
            engines["process"] = ProcessEngine(os.path.join(self.data_dir, "process"))
        except EngineUnavailable as exc:
            self.unavailable["process"] = str(exc)
        from forkd_engine.vm import VMEngine, qemu_binary
        if qemu_binary() is None:
            self.unavailable["vm"] = "qemu-system-x86_64 is not installed (scripts/setup.sh installs it)"
        else:
            try:
                # preferred (picked by engine "auto") only where KVM is usable; TCG is correct but slow.
                engines["vm"] = VMEngine(os.path.join(self.data_dir, "vm"))
            except EngineUnavailable as exc:
                self.unavailable["vm"] = str(exc)
        return engines

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.registry.close()

    # --- events ----------------------------------------------------------------------------------

    def subscribe(self, listener: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``listener(event)`` on every change; returns a function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def publish(self, kind: str, action: str, **data) -> None:
        """Send a change event of a manager beside the controller (kernels) to every listener."""
        self._emit(kind, action, **data)

    def _emit(self, kind: str, action: str, **data) -> None:
        event = {"kind": kind, "action": action, "time": time.time(), **data}
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a broken listener must not break the controller
                pass
        with self._changed:
            self._changed.notify_all()

    # --- helpers ---------------------------------------------------------------------------------

    def _engine(self, name: str):
        if name == "auto":
            name = self.default_engine if self.default_engine != "auto" else (
                "vm" if "vm" in self.engines and getattr(self.engines["vm"], "preferred", False) else "process")
        engine = self.engines.get(name)
        if engine is None:
            why = self.unavailable.get(name) or f"available: {', '.join(sorted(self.engines)) or 'none'}"
            raise BadRequest(f"engine {name!r} is not available on this server ({why}); see `forkd doctor`")
        return name, engine

    def _sandbox_row(self, sandbox_id) -> dict:
        row = self.registry.get_sandbox(sandbox_id) if isinstance(sandbox_id, str) else None
        if row is None or row["status"] != "running" or not self._sandbox_alive(row):
            raise NotFound(f"sandbox {sandbox_id} not found")
        return row

    def sandbox_engine(self, sandbox_id) -> tuple:
        """(engine, handle) of a running sandbox, for managers that talk to its agent (404 if none)."""
        row = self._sandbox_row(sandbox_id)
        return self.engines[row["engine"]], row["handle"]

    def interrupt(self, sandbox_id) -> dict:
        """Raise KeyboardInterrupt in the cell the sandbox is running (``interrupted``: was there one)."""
        return self._agent(sandbox_id, {"action": "interrupt"}, "interrupt", timeout=5)

    def _sandbox_alive(self, row: dict) -> bool:
        """True if its process lives; a sandbox that died outside our control is dropped."""
        engine = self.engines.get(row["engine"])
        if engine is not None and row["handle"] and engine.alive(row["handle"]):
            return True
        if engine is not None and row["handle"]:
            engine.kill(row["handle"])  # releases what it held (socket, cgroup leaves)
        self.registry.delete_sandboxes([row["id"]])
        self._emit("sandbox", "killed", id=row["id"], reason="its process ended unexpectedly")
        return False

    def _snapshot_checked(self, row: dict) -> dict:
        """A ready snapshot whose template died outside our control becomes failed, with a reason."""
        if row["status"] != "ready":
            return row
        engine = self.engines.get(row["engine"])
        if engine is not None and engine.alive(row["handle"]):
            return row
        if engine is not None:
            engine.delete_snapshot(row["handle"])
        warning = "snapshot is not bootable: its template process ended unexpectedly"
        self.registry.update_snapshot(row["tag"], status="failed", warning=warning)
        self._emit("snapshot", "status", tag=row["tag"], status="failed", warning=warning)
        return dict(row, status="failed", warning=warning)

    def _agent(self, sandbox_id: str, request: dict, what: str, timeout: float | None = None) -> dict:
        row = self._sandbox_row(sandbox_id)
        engine = self.engines.get(row["engine"])
        try:
            return engine.call(row["handle"], request, timeout=timeout)
        except (AgentUnreachable, EngineError) as exc:
            raise EngineFailure(f"{what}: {exc}") from exc

    def snapshot_info(self, row: dict) -> dict:
        info = {
            "tag": row["tag"],
            # where the snapshot lives: a directory for the VM engine, the template's socket for
            # the process engine (its memory is a parked process, not files)
            "dir": (row["handle"] or {}).get("dir") or (row["handle"] or {}).get("socket"),
            "created_at_unix": int(row["created_at"]),
            "status": row["status"],
            "bootable": row["status"] == "ready",
            "engine": row["engine"],
            "lineage": row["lineage"],
        }
        if row["branched_from"]:
            info["branched_from"] = row["branched_from"]
        if row["pause_ms"] is not None:
            info["pause_ms"] = row["pause_ms"]
        if row["prepare_ms"]:
            info["prepare_ms"] = row["prepare_ms"]
        if row["warning"]:
            info["warning"] = row["warning"]
        return info

    @staticmethod
    def sandbox_info(row: dict) -> dict:
        handle = row["handle"] or {}
        return {
            "id": row["id"],
            "snapshot_tag": row["snapshot_tag"],
            "netns": None,
            "guest_addr": f"unix:{handle['socket']}" if handle.get("socket") else None,
            "created_at_unix": int(row["created_at"]),
            "pid": handle.get("pid"),
            "memory_limit_mib": row["memory_limit_mib"],
            "has_branched": row["branch_count"] > 0,
            "last_branch_memory_path": None,
            "branch_count": row["branch_count"],
            "engine": row["engine"],
            "status": row["status"],
            "lineage": row["lineage"],
        }

    # --- start-up --------------------------------------------------------------------------------

    def reconcile(self) -> dict:
        """Re-attach to what survived a restart; record what did not. Returns counts."""
        counts = {"snapshots_attached": 0, "snapshots_failed": 0, "sandboxes_attached": 0, "sandboxes_dropped": 0}
        for row in self.registry.list_snapshots():
            if row["status"] == "ready":
                ready = self._snapshot_checked(row)["status"] == "ready"
                counts["snapshots_attached" if ready else "snapshots_failed"] += 1
            elif row["status"] == "writing":
                # Its writer (this server, before the restart) is gone: end what it left, record why.
                engine = self.engines.get(row["engine"])
                if engine is not None:
                    if row["handle"]:
                        engine.delete_snapshot(row["handle"])
                    else:
                        engine.abandon("snap:" + row["tag"])
                self.registry.update_snapshot(row["tag"], status="failed", warning="snapshot is not bootable: "
                                              "interrupted by a server restart while it was being written")
                counts["snapshots_failed"] += 1
        for row in self.registry.list_sandboxes():
            if row["status"] == "running" and row["handle"]:
                alive = self._sandbox_alive(row)  # drops (and cleans up after) the dead
                counts["sandboxes_attached" if alive else "sandboxes_dropped"] += 1
                continue
            engine = self.engines.get(row["engine"])  # a spawn the restart interrupted
            if engine is not None:
                engine.abandon(row["id"])
            self.registry.delete_sandboxes([row["id"]])
            counts["sandboxes_dropped"] += 1
        counts.update(self._reconcile_workspaces())
        return counts

    # --- snapshots -------------------------------------------------------------------------------

    def create_snapshot(self, tag, *, engine: str = "auto", setup: str | None = None,
                        setup_commands: list | None = None, mem_size_mib: int | None = None,
                        host_network: bool = False, disk_mib: int | None = None,
                        packages: list[str] | None = None, lossy: bool = False, shell: str = "plain") -> dict:
        check_tag(tag)
        if engine not in ENGINES:
            raise BadRequest(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if shell not in ("plain", "ipython"):
            raise BadRequest(f"shell must be plain or ipython, got {shell!r}")
        if setup is not None and not isinstance(setup, str):
            raise BadRequest("setup must be a string of Python code")
        commands = setup_commands or []
        if not isinstance(commands, list) or not all(
                isinstance(c, list) and c and all(isinstance(a, str) for a in c) for c in commands):
            raise BadRequest("setup_commands must be a list of argv lists, e.g. [[\"pip\", \"install\", \"x\"]]")
        if mem_size_mib is not None:
            _int_field(mem_size_mib, "mem_size_mib", 64, 1 << 20)
        if disk_mib is not None:
            _int_field(disk_mib, "disk_mib", 16, 1 << 20)
        if packages:
            from forkd_engine.vm.image import ImageError, validate_packages
            try:
                packages = validate_packages(packages)
            except ImageError as exc:
                raise BadRequest(str(exc)) from None
        packages = list(packages or [])
        if engine == "auto" and (packages or disk_mib is not None):
            engine = "vm"  # what was asked for exists only in a VM guest (as forkd's kernel/rootfs form)
        name, eng = self._engine(engine)
        if disk_mib is not None and name != "vm":
            raise BadRequest("disk_mib needs engine vm (a process sandbox's files live in its private layer)")
        if packages and name != "vm":
            raise BadRequest("packages need engine vm (a process sandbox runs the host's Python environment; "
                             "add software there with setup_commands)")
        with self._lock:
            if tag in self._in_flight:
                raise Conflict(f"snapshot {tag} is already being written")
            if self.registry.get_snapshot(tag) is not None:
                raise BadRequest(f"snapshot {tag} already exists; DELETE first")
            self._in_flight.add(tag)
        try:
            spec = SnapshotSpec(tag=tag, setup=setup, setup_commands=commands, host_network=bool(host_network),
                                mem_size_mib=mem_size_mib, disk_mib=disk_mib, packages=packages, lossy=bool(lossy),
                                shell=shell)
            self.registry.insert_snapshot({
                "tag": tag, "engine": name, "status": "writing", "created_at": time.time(),
                "lineage": [tag], "spec": {"setup": setup, "setup_commands": commands,
                                           "host_network": bool(host_network), "mem_size_mib": mem_size_mib,
                                           "disk_mib": disk_mib, "packages": packages, "shell": shell}})
            self._emit("snapshot", "created", tag=tag, status="writing")
            try:
                handle = eng.create_snapshot(spec)
            except EngineError as exc:
                self.registry.delete_snapshot(tag)
                self._emit("snapshot", "deleted", tag=tag)
                if isinstance(exc, InvalidSpec):  # e.g. an unknown package: the request's fault
                    raise BadRequest(str(exc)) from None
                if isinstance(exc, LossyFork):
                    raise lossy_refusal(exc, f"snapshot {tag}: every sandbox is a fork of it, and its setup") from None
                raise EngineFailure(str(exc)) from exc
            self.registry.update_snapshot(tag, status="ready", handle=handle)
            self._emit("snapshot", "status", tag=tag, status="ready")
            return self.snapshot_info(self.registry.get_snapshot(tag))
        finally:
            with self._lock:
                self._in_flight.discard(tag)

    def list_snapshots(self) -> list[dict]:
        rows = [self._snapshot_checked(r) for r in self.registry.list_snapshots()]
        done = [self.snapshot_info(r) for r in rows if r["status"] != "writing"]
        return done + [self.snapshot_info(r) for r in rows if r["status"] == "writing"]

    def get_snapshot(self, tag) -> dict:
        check_tag(tag)
        row = self.registry.get_snapshot(tag)
        if row is None:
            raise NotFound(f"snapshot {tag} not found")
        return self.snapshot_info(self._snapshot_checked(row))

    def snapshot_detail(self, tag) -> dict:
        """forkd's SnapshotInfoDetail, plus lineage and live memory figures."""
        info = self.get_snapshot(tag)
        row = self.registry.get_snapshot(tag)
        rows = self.registry.list_snapshots()
        info.update({
            "ancestors": row["lineage"][:-1],
            "chain_depth": 0,
            "dependents": [],
            "descendants": [r["tag"] for r in rows if r["tag"] != tag and tag in r["lineage"]],
            "sandboxes": [s["id"] for s in self.registry.list_sandboxes() if s["snapshot_tag"] == tag],
        })
        engine = self.engines.get(row["engine"])
        if row["status"] == "ready" and engine is not None and engine.alive(row["handle"]):
            info["memory"] = engine.memory(row["handle"])
        return info

    def delete_snapshot(self, tag, *, cascade: bool = False, force: bool = False) -> None:
        check_tag(tag)
        if cascade and force:
            raise BadRequest("cascade and force are mutually exclusive")
        with self._lock:
            if tag in self._in_flight:
                raise Conflict(f"snapshot {tag} is being written; wait until it is ready or failed")
        row = self.registry.get_snapshot(tag)
        if row is None:
            raise NotFound(f"snapshot {tag} not found")
        # Snapshots never depend on each other here (a branch is a complete snapshot), so force has
        # nothing to orphan; cascade also deletes every snapshot branched further down the lineage.
        victims = [row]
        if cascade:
            victims += [r for r in self.registry.list_snapshots() if r["tag"] != tag and tag in r["lineage"]]
        states = {w["current_state_tag"]: w["name"] for w in self.registry.list_workspaces() if w["current_state_tag"]}
        for victim in victims:
            if victim["tag"] in states:
                name = states[victim["tag"]]
                raise Conflict(f"snapshot {victim['tag']} holds the state of workspace {name}"
                               + (f" (cascade from {tag} would delete it)" if victim["tag"] != tag else "")
                               + f"; delete the workspace instead (DELETE /v1/workspaces/{name})")
        for victim in reversed(victims):
            engine = self.engines.get(victim["engine"])
            if victim["handle"] and engine is not None:
                engine.delete_snapshot(victim["handle"])
            self.registry.delete_snapshot(victim["tag"])
            self._emit("snapshot", "deleted", tag=victim["tag"])

    # --- sandboxes -------------------------------------------------------------------------------

    def spawn(self, snapshot_tag, n=1, *, memory_limit_mib=None, **_forkd_options) -> list[dict]:
        """Fork ``n`` sandboxes from a snapshot. forkd's VM-only options are accepted and ignored."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise BadRequest(f"n must be an integer, got {n!r}")
        if n == 0:
            raise BadRequest("n must be at least 1")
        if n > MAX_CHILDREN or n < 0:
            raise BadRequest(f"n must be between 1 and {MAX_CHILDREN}")
        check_tag(snapshot_tag, "snapshot_tag")
        if memory_limit_mib is not None:
            _int_field(memory_limit_mib, "memory_limit_mib", 16)
        row = self.registry.get_snapshot(snapshot_tag)
        row = row and self._snapshot_checked(row)
        if row is not None and row["status"] != "ready":
            raise Conflict(f"snapshot `{snapshot_tag}` is not bootable: status={row['status']}"
                           + (f"; {row['warning']}" if row["warning"] else ""))
        if row is None:
            raise NotFound(f"snapshot {snapshot_tag} not found")
        engine = self.engines[row["engine"]]
        first = self.registry.next_counter("sandbox", n)
        now = time.time()
        ids = [f"sb-{int(now):08x}-{(first + i) % 0x10000:04x}" for i in range(n)]
        rows = [{"id": sid, "snapshot_tag": snapshot_tag, "engine": row["engine"], "status": "starting",
                 "created_at": now, "lineage": row["lineage"] + [sid], "memory_limit_mib": memory_limit_mib}
                for sid in ids]
        self.registry.insert_sandboxes(rows)
        try:
            handles = engine.spawn(row["handle"], [ChildSpec(id=r["id"], lineage=r["lineage"],
                                                             memory_limit_mib=memory_limit_mib) for r in rows])
        except EngineError as exc:
            self.registry.delete_sandboxes(ids)
            raise EngineFailure(str(exc)) from exc
        self.registry.set_sandbox_handles(dict(zip(ids, handles)))
        out = [self.sandbox_info(self.registry.get_sandbox(sid)) for sid in ids]
        for info in out:
            self._emit("sandbox", "created", id=info["id"], snapshot_tag=snapshot_tag, status="running")
        return out

    def list_sandboxes(self) -> list[dict]:
        _gen, infos, live = self.sandbox_listing()
        return [dict(info) for info, ok in zip(infos, live) if ok]

    def sandbox_listing(self) -> tuple[int, list[dict], list[bool]]:
        """(generation, infos, alive) of every running sandbox: ``infos`` are shared and read-only
        and stay the same objects while ``generation`` does (the registry did not change), so a
        caller may cache what it derives from them; ``alive`` is checked on every call."""
        gen, rows = self.registry.sandbox_table()
        listing = self._listing
        if listing is None or listing[0] != gen:
            running = [r for r in rows if r["status"] == "running"]
            listing = self._listing = (gen, running, [self.sandbox_info(r) for r in running])
        _gen, running, infos = listing
        alive = self._alive_many(running)
        return gen, infos, [alive[r["id"]] or self._sandbox_alive(r) for r in running]

    def _alive_many(self, rows: list[dict]) -> dict[str, bool]:
        """Liveness of many sandboxes, asking each engine once when it can answer in bulk."""
        out: dict[str, bool] = {}
        for name, engine in self.engines.items():
            mine = [r for r in rows if r["engine"] == name and r["handle"]]
            bulk = getattr(engine, "alive_many", None)
            flags = bulk([r["handle"] for r in mine]) if bulk else [engine.alive(r["handle"]) for r in mine]
            out.update((r["id"], f) for r, f in zip(mine, flags))
        return {r["id"]: out.get(r["id"], False) for r in rows}

    def get_sandbox(self, sandbox_id) -> dict:
        return self.sandbox_info(self._sandbox_row(sandbox_id))

    def kill_sandbox(self, sandbox_id) -> None:
        row = self._sandbox_row(sandbox_id)
        self.engines[row["engine"]].kill(row["handle"])
        self.registry.delete_sandboxes([row["id"]])
        self._emit("sandbox", "killed", id=row["id"])

    def memory(self, sandbox_id) -> dict:
        row = self._sandbox_row(sandbox_id)
        return self.engines[row["engine"]].memory(row["handle"])

    # --- talking to the agent --------------------------------------------------------------------

    def ping(self, sandbox_id) -> dict:
        return self._agent(sandbox_id, {"action": "ping"}, "ping", timeout=5)

    def exec(self, sandbox_id, args, timeout_secs: float = 30, env: dict | None = None, cwd: str | None = None) -> dict:
        self._sandbox_row(sandbox_id)
        if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
            raise BadRequest("args must be a non-empty list of strings")
        if isinstance(timeout_secs, bool) or not isinstance(timeout_secs, (int, float)) or timeout_secs <= 0:
            raise BadRequest("timeout_secs must be a positive number")
        request = {"action": "exec", "args": args, "timeout": timeout_secs}
        if env:
            request["env"] = env
        if cwd:
            request["cwd"] = cwd
        reply = self._agent(sandbox_id, request, "exec", timeout=timeout_secs + 5)
        out = {"stdout": reply.get("stdout", ""), "stderr": reply.get("stderr", ""),
               "exit_code": reply.get("exit_code", 1)}
        for extra in ("error", "timed_out"):
            if extra in reply:
                out[extra] = reply[extra]
        return out

    def eval(self, sandbox_id, code) -> dict:
        self._sandbox_row(sandbox_id)
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        reply = self._agent(sandbox_id, {"action": "eval", "code": code}, "eval", timeout=300)
        return {"result": reply.get("result"), "error": reply.get("error"), "exit_code": reply.get("exit_code", 1)}

    def run_code(self, sandbox_id, code, timeout: float = 600) -> dict:
        self._sandbox_row(sandbox_id)
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        return self._agent(sandbox_id, {"action": "run_code", "code": code}, "run_code", timeout=timeout)

    def files(self, sandbox_id, op: str, path, **options) -> dict:
        self._sandbox_row(sandbox_id)
        if op not in ("read", "write", "list", "remove"):
            raise BadRequest(f"unknown files op {op!r}: use read, write, list or remove")
        if not isinstance(path, str) or not path or "\0" in path:
            raise BadRequest("path must be a non-empty string")
        reply = self._agent(sandbox_id, {"action": "files", "op": op, "path": path, **options}, "files")
        if "error" in reply:
            msg = reply["error"]
            if msg.startswith(("FileNotFoundError", "NotADirectoryError")):
                raise NotFound(f"{path}: {msg.split(': ', 1)[-1]}")
            raise BadRequest(msg)
        return reply

    # --- branch ----------------------------------------------------------------------------------

    def branch(self, sandbox_id, tag=None, *, mode=None, diff=False, live=False, measure_diff=False,
               wait=True, parent_tag=None, lossy=False) -> dict:
        """Turn a running sandbox into a new snapshot, in forkd's check order.

        Returns SnapshotInfo; with ``wait=False`` it has status ``writing`` and turns ``ready`` or
        ``failed`` later (``wait_snapshot`` waits for that).
        """
        if tag is None:
            known = isinstance(sandbox_id, str) and self.registry.get_sandbox(sandbox_id) is not None
            seq = self.registry.next_counter(f"branch:{sandbox_id}") if known else 0
            tag = f"branch-{sandbox_id}-{seq}"
        check_tag(tag)
        release = self._take_slot(tag)
        try:
            if mode is not None and (diff or live):
                raise BadRequest("mode cannot be combined with diff or live")
            if mode is not None and mode not in BRANCH_MODES:
                raise BadRequest(f"mode must be one of {', '.join(BRANCH_MODES)}, got {mode!r}")
            diff, live = diff or mode == "diff", live or mode == "live"
            if sum(map(bool, (measure_diff, diff, live))) > 1:
                raise BadRequest("only one of measure_diff, diff and live may be set")
            if not wait and not live:
                raise BadRequest("wait=false needs mode live (the branch returns while memory is still being written)")
            if self.registry.get_snapshot(tag) is not None:
                raise Conflict(f"snapshot {tag} already exists; DELETE first")
            row = self._sandbox_row(sandbox_id)
            if parent_tag is not None and parent_tag != row["snapshot_tag"]:
                raise BadRequest(f"parent_tag {parent_tag!r} is not the source's snapshot {row['snapshot_tag']!r}")
            if parent_tag is not None and not diff:
                raise BadRequest("parent_tag needs diff mode")
        except BaseException:
            release()
            raise
        return self._branch_into(row, tag, "live" if live else "diff" if diff else "full", release, wait=wait,
                                 lossy=bool(lossy))

    def _take_slot(self, tag: str) -> Callable[[], None]:
        """Reserve a branch concurrency slot for writing ``tag``: 409 if ``tag`` is in flight, 503 at
        the cap. Returns the release (idempotent; ``_branch_into`` calls it when the write ends)."""
        with self._lock:
            if tag in self._in_flight:
                raise Conflict(f"a branch to {tag} is already in flight")
            if self._branches >= self.branch_cap:
                raise Busy(f"branch concurrency limit reached ({self.branch_cap} in flight); retry shortly")
            self._in_flight.add(tag)
            self._branches += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._in_flight.discard(tag)
                    self._branches -= 1

        return release

    def _branch_into(self, row: dict, tag: str, mode: str, release: Callable[[], None], *, wait: bool = True,
                     lineage: list[str] | None = None, branched_from: str | None = None, spec: dict | None = None,
                     record_pause: bool = True, lossy: bool = False) -> dict:
        """Branch the running sandbox ``row`` into snapshot ``tag`` while holding the slot ``release``
        frees: the slot goes back when the snapshot is ready or failed, or at once on an error."""
        try:
            engine = self.engines[row["engine"]]
            lineage = lineage or row["lineage"] + [tag]
            branched_from = branched_from or row["id"]
            self.registry.insert_snapshot({
                "tag": tag, "engine": row["engine"], "status": "writing", "created_at": time.time(),
                "branched_from": branched_from, "lineage": lineage,
                "spec": spec or {"branched_from": row["id"], "mode": mode}})
            try:
                result = engine.branch(row["handle"], tag, lineage, mode, lossy=lossy)
            except BaseException as exc:  # nothing was written: no row, and the slot goes back
                self.registry.delete_snapshot(tag)
                if isinstance(exc, LossyFork):
                    raise lossy_refusal(exc, f"branch of {row['id']}") from None
                if isinstance(exc, UnsupportedMode):  # valid request, impossible here: a 4xx naming why
                    raise BadRequest(f"branch: {exc}") from exc
                if isinstance(exc, (EngineError, AgentUnreachable)):
                    raise EngineFailure(f"branch: {exc}") from exc
                raise
            if record_pause:
                self.registry.update_snapshot(tag, pause_ms=result.pause_ms, prepare_ms=result.prepare_ms)
            self.registry.update_sandbox(row["id"], branch_count=row["branch_count"] + 1)
            self._emit("snapshot", "created", tag=tag, status="writing", branched_from=branched_from,
                       **({"pause_ms": result.pause_ms} if record_pause else {}))

            settled = threading.Event()

            def complete(future) -> None:
                try:
                    fields = {"status": "ready", "handle": future.result()}
                except BaseException as exc:  # noqa: BLE001
                    fields = {"status": "failed", "warning": f"branch failed: {exc}"}
                self.registry.update_snapshot(tag, **fields)
                release()
                settled.set()
                self._emit("snapshot", "status", tag=tag, status=fields["status"],
                           **({"warning": fields["warning"]} if "warning" in fields else {}))

            result.ready.add_done_callback(complete)
            if wait:
                try:
                    result.ready.result(timeout=600)
                except FutureTimeout:
                    raise EngineFailure(f"branch {tag} did not become ready within 600 s") from None
                except EngineError as exc:
                    raise EngineFailure(f"branch: {exc}") from exc
                settled.wait()  # the done-callback may still be running in the engine's thread
            info = self.snapshot_info(self.registry.get_snapshot(tag))
            if result.warnings:
                info["warnings"] = list(result.warnings)
            return info
        except BaseException:
            written = self.registry.get_snapshot(tag)
            if written is None or written["status"] != "writing":
                release()
            raise

    def compact_snapshot(self, tag, to) -> dict:
        """An independent copy of snapshot ``tag`` under ``to`` (forkd's compact), in forkd's order:
        unsafe tag 400, unsafe ``to`` 400, ``to == tag`` 400, the branch slot (409 in flight, 503 at
        the cap), ``to`` exists 409, unknown ``tag`` 404, engine failure 500.

        Snapshots here never form diff chains, so compacting is a copy: a sandbox of ``tag`` is
        branched (mode full) into ``to`` and killed. The copy is a root of its own lineage: deleting
        ``tag``, even with cascade, leaves it. No engine API beyond spawn, branch and kill.
        """
        check_tag(tag)
        check_tag(to, "to")
        if to == tag:
            raise BadRequest(f"to must differ from the snapshot being compacted ({tag!r})")
        release = self._take_slot(to)
        helper = None
        try:
            try:
                if self.registry.get_snapshot(to) is not None:
                    raise Conflict(f"snapshot {to} already exists; DELETE first")
                if self.registry.get_snapshot(tag) is None:
                    raise NotFound(f"snapshot {tag} not found")
                helper = self.spawn(tag, 1)[0]["id"]
                row = self.registry.get_sandbox(helper)
                if row is None or not self._sandbox_alive(row):
                    raise EngineFailure(f"compact: the sandbox of {tag} to copy from ended before the copy")
            except BaseException:
                release()
                raise
            return self._branch_into(row, to, "full", release, lineage=[to], branched_from=f"compact:{tag}",
                                     spec={"compacted_from": tag, "mode": "full"}, record_pause=False)
        finally:
            if helper is not None:
                self._kill_quietly(helper)

    def _kill_quietly(self, sandbox_id: str) -> bool:
        """Kill a sandbox we started for our own purposes; True when it is gone (or was already)."""
        row = self.registry.get_sandbox(sandbox_id)
        if row is None:
            return True
        engine = self.engines.get(row["engine"])
        try:
            if engine is not None and row["handle"]:
                engine.kill(row["handle"])
        except Exception:  # noqa: BLE001 - the caller's result stands; reconcile retries where it records the duty
            return False
        self.registry.delete_sandboxes([sandbox_id])
        self._emit("sandbox", "killed", id=sandbox_id)
        return True

    def wait_snapshot(self, tag, timeout: float = 60.0) -> dict:
        """Block until a snapshot is ``ready`` or ``failed``; returns its info."""
        check_tag(tag)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                row = self.registry.get_snapshot(tag)
                if row is None:
                    raise NotFound(f"snapshot {tag} not found")
                if row["status"] != "writing":
                    return self.snapshot_info(row)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ForkdError(f"snapshot {tag} is still writing after {timeout:g} s")
                self._changed.wait(left)

    # --- workspaces ------------------------------------------------------------------------------
    # A workspace is a named, long-lived sandbox that can be suspended into a snapshot
    # (``ws-<name>-state``) and resumed from it. Its row lives in the registry, so it survives a
    # restart; at start-up a running workspace whose sandbox is gone becomes ``stale``.
    #
    # Suspend never loses state: the new state is written under a pending tag first, while the
    # sandbox keeps running; one transaction then makes it ``ws-<name>-state`` (dropping the previous
    # state's row) and records what is left to retire (the sandbox, the previous state's engine
    # objects) in the workspace row, and only then are those killed and deleted. A crash at any
    # point leaves the old state or the new one, and reconcile finishes or undoes what was pending.

    @staticmethod
    def state_tag(name: str) -> str:
        return f"ws-{name}-state"

    @staticmethod
    def workspace_info(row: dict) -> dict:
        info = {
            "id": row["id"],
            "name": row["name"],
            "source_snapshot_tag": row["source_snapshot_tag"],
            "status": row["status"],
            "created_at_unix": int(row["created_at"]),
            "last_active_unix": int(row["last_active"]),
            "memory_limit_mib": row["memory_limit_mib"],
        }
        for key in ("current_state_tag", "live_sandbox_id", "last_branch_memory_path"):
            if row[key]:
                info[key] = row[key]
        return info

    def _ws_row(self, name) -> dict:
        row = self.registry.get_workspace(name) if isinstance(name, str) else None
        if row is None:
            raise NotFound(f"workspace {name} not found")
        return row

    def _ws_acquire(self, name: str, op: str, *, try_only: bool = False) -> bool:
        """Hold workspace ``name`` for one operation (never blocks): True, or 409 Conflict when
        another operation holds it (False instead with ``try_only``)."""
        with self._lock:
            holder = self._ws_busy.get(name)
            if holder is None:
                self._ws_busy[name] = op
                return True
        if try_only:
            return False
        raise Conflict(f"workspace {name} is busy ({holder} in progress); retry when it is done")

    def _ws_release(self, name: str) -> None:
        with self._lock:
            self._ws_busy.pop(name, None)

    def _ws_sandbox(self, row: dict) -> dict | None:
        """The workspace's live sandbox row, or None when it is gone."""
        sb = self.registry.get_sandbox(row["live_sandbox_id"]) if row["live_sandbox_id"] else None
        if sb is None or sb["status"] != "running" or not sb["handle"] or not self._sandbox_alive(sb):
            return None
        return sb

    def _ws_mark_stale(self, row: dict) -> dict:
        if self.registry.mark_workspace_stale(row["name"], row["live_sandbox_id"]):
            self._emit("workspace", "status", name=row["name"], status="stale")
        return dict(row, status="stale", live_sandbox_id=None)

    def _ws_checked(self, row: dict) -> dict:
        """A running workspace whose sandbox died (killed through the sandbox API, say) is stale.
        Skipped while an operation holds the workspace: it is changing the sandbox itself."""
        if row["status"] != "running" or not self._ws_acquire(row["name"], "a status check", try_only=True):
            return row
        try:
            row = self.registry.get_workspace(row["name"]) or row
            if row["status"] == "running" and self._ws_sandbox(row) is None:
                row = self._ws_mark_stale(row)
            return row
        finally:
            self._ws_release(row["name"])

    def list_workspaces(self) -> list[dict]:
        return [self.workspace_info(self._ws_checked(r)) for r in self.registry.list_workspaces()]

    def get_workspace(self, name) -> dict:
        return self.workspace_info(self._ws_checked(self._ws_row(name)))

    def create_workspace(self, name, snapshot_tag, *, memory_limit_mib=None, **_forkd_options) -> dict:
        """A workspace running one sandbox of ``snapshot_tag``, in forkd's order: unsafe name 400,
        unsafe snapshot_tag 400, the name exists 409, then the spawn's own answers (404 unknown
        snapshot, 409 not bootable, 500). forkd's ``per_child_netns`` is accepted and ignored."""
        check_tag(name, "name")
        if len(name) > WORKSPACE_NAME_MAX:
            raise BadRequest(f"invalid name {name!r}: a workspace name has at most {WORKSPACE_NAME_MAX} "
                             f"characters (its state snapshot ws-<name>-state must be a valid tag)")
        check_tag(snapshot_tag, "snapshot_tag")
        if memory_limit_mib is not None:
            _int_field(memory_limit_mib, "memory_limit_mib", 16)
        self._ws_acquire(name, "create")
        try:
            if self.registry.get_workspace(name) is not None:
                raise Conflict(f"workspace {name} already exists")
            state_tag = self.state_tag(name)
            if self.registry.get_snapshot(state_tag) is not None:
                raise Conflict(f"snapshot {state_tag} already exists and is not this workspace's; the workspace "
                               f"would keep its state under that tag: delete the snapshot or choose another name")
            kid = self.spawn(snapshot_tag, 1, memory_limit_mib=memory_limit_mib)[0]
            now = time.time()
            try:
                self.registry.insert_workspace({
                    "name": name, "id": "ws-" + kid["id"][:16], "source_snapshot_tag": snapshot_tag,
                    "status": "running", "live_sandbox_id": kid["id"], "memory_limit_mib": memory_limit_mib,
                    "created_at": now, "last_active": now})
            except BaseException:
                self._kill_quietly(kid["id"])
                raise
            self._emit("workspace", "created", name=name, status="running", live_sandbox_id=kid["id"])
            return self.workspace_info(self.registry.get_workspace(name))
        finally:
            self._ws_release(name)

    def suspend_workspace(self, name, *, diff: bool = False) -> dict:
        """Snapshot the workspace's sandbox into ``ws-<name>-state`` (mode full, or diff) and kill it,
        in forkd's order: unknown 404, not running 400, busy 409 / 503, sandbox gone 404."""
        row = self._ws_row(name)
        if row["status"] != "running":
            raise BadRequest(f"workspace {name} is not running (status {row['status']})")
        state_tag = self.state_tag(name)
        self._ws_acquire(name, "suspend")
        try:
            with self._lock:
                if state_tag in self._in_flight:
                    raise Conflict(f"a branch to {state_tag} is already in flight")
                self._in_flight.add(state_tag)
            try:
                return self._suspend(name, state_tag, "diff" if diff else "full")
            finally:
                with self._lock:
                    self._in_flight.discard(state_tag)
        finally:
            self._ws_release(name)

    def _suspend(self, name: str, state_tag: str, mode: str) -> dict:
        row = self._ws_row(name)  # again, now that we hold it
        if row["status"] != "running":
            raise BadRequest(f"workspace {name} is not running (status {row['status']})")
        # The pending tag carries '@', which no user tag may: nobody else can take it, and the
        # engines' objects (named by the tag they were written under) are never reused.
        pending = f"{state_tag}@{self.registry.next_counter('workspace-state')}"
        release = self._take_slot(pending)
        try:
            sb = self._ws_sandbox(row)
            if sb is None:
                self._ws_mark_stale(row)
                raise NotFound(f"sandbox {row['live_sandbox_id']} not found: workspace {name}'s sandbox is gone "
                               f"(the workspace is now stale; resume it to start again from its last state)")
            previous = self.registry.get_snapshot(state_tag)
            if previous is not None and not (row["current_state_tag"] == state_tag
                                             and (previous["spec"] or {}).get("workspace") == name):
                raise Conflict(f"snapshot {state_tag} exists and is not workspace {name}'s state; delete it "
                               f"to let the workspace suspend")
        except BaseException:
            release()
            raise
        # [source's lineage..., the sandbox, state]: a resumed sandbox's own earlier generations
        # (previous sandbox, previous state) are left out, so the lineage stays this short.
        ancestors = sb["lineage"][:-1]
        if state_tag in ancestors:
            ancestors = ancestors[:max(0, ancestors.index(state_tag) - 1)]
        lineage = ancestors + [sb["id"]]
        spec = {"branched_from": sb["id"], "mode": mode, "workspace": name}
        self._branch_into(sb, pending, mode, release, lineage=lineage + [pending],
                          spec=dict(spec, workspace_pending=True, engine_tag=pending))
        # The new state is safe under `pending`; the sandbox still runs. Swap, then retire.
        self._ws_commit_state(row, self.registry.get_snapshot(pending), previous, lineage + [state_tag], spec)
        self._ws_retire(name)
        self._emit("workspace", "suspended", name=name, status="suspended", current_state_tag=state_tag)
        return self.workspace_info(self.registry.get_workspace(name))

    def _ws_commit_state(self, row: dict, pending: dict, previous: dict | None, lineage: list[str],
                         spec: dict) -> None:
        """Make snapshot ``pending`` the workspace's state in one transaction, recording the sandbox
        and the previous state's engine objects as what is left to retire."""
        name, state_tag = row["name"], self.state_tag(row["name"])
        retiring = {"sandbox": row["live_sandbox_id"],
                    "snapshot": {"engine": previous["engine"], "handle": previous["handle"]}
                    if previous is not None and previous["handle"] else None}
        # Whatever still names the previous state (a sandbox forked from it, a branch below one)
        # keeps working (snapshots are standalone, a sandbox outlives its snapshot) and names it by
        # the tag it was written under, so the tree never hangs it under the new state.
        retired_as = None if previous is None else (previous["spec"] or {}).get("engine_tag") or f"{state_tag}@retired"
        self.registry.commit_workspace_state(
            name, pending["tag"], state_tag, lineage=lineage, retired_as=retired_as,
            spec=dict(spec, engine_tag=pending["tag"]),
            workspace={"status": "suspended", "live_sandbox_id": None, "current_state_tag": state_tag,
                       "last_active": time.time(), "retiring": retiring,
                       "last_branch_memory_path": (pending["handle"] or {}).get("memory")})
        self._emit("snapshot", "deleted", tag=pending["tag"])
        if previous is not None:
            self._emit("snapshot", "deleted", tag=state_tag)
        self._emit("snapshot", "created", tag=state_tag, status="ready", branched_from=pending["branched_from"])

    def _ws_retire(self, name: str) -> None:
        """Kill and delete what a suspend left to retire; kept for reconcile if anything fails."""
        row = self.registry.get_workspace(name)
        duty = (row or {}).get("retiring") or {}
        done = True
        if duty.get("sandbox"):
            done = self._kill_quietly(duty["sandbox"])
        snap = duty.get("snapshot")
        if snap:
            engine = self.engines.get(snap["engine"])
            try:
                if engine is not None:
                    engine.delete_snapshot(snap["handle"])
            except Exception:  # noqa: BLE001 - retried by reconcile
                done = False
        if duty and done:
            self.registry.update_workspace(name, retiring=None)

    def resume_workspace(self, name) -> dict:
        """Fork the workspace's sandbox again from its state (or its source snapshot if it was never
        suspended), with its memory limit: unknown 404, already running 400, busy 409, then the
        spawn's answers (404 when the snapshot is gone, 409 not bootable, 500)."""
        row = self._ws_row(name)
        if row["status"] == "running":
            raise BadRequest(f"workspace {name} is already running")
        self._ws_acquire(name, "resume")
        try:
            row = self._ws_row(name)
            if row["status"] == "running":
                raise BadRequest(f"workspace {name} is already running")
            kid = self.spawn(row["current_state_tag"] or row["source_snapshot_tag"], 1,
                             memory_limit_mib=row["memory_limit_mib"])[0]
            try:
                self.registry.update_workspace(name, status="running", live_sandbox_id=kid["id"],
                                               last_active=time.time())
            except BaseException:
                self._kill_quietly(kid["id"])
                raise
            self._emit("workspace", "resumed", name=name, status="running", live_sandbox_id=kid["id"])
            return self.workspace_info(self.registry.get_workspace(name))
        finally:
            self._ws_release(name)

    def delete_workspace(self, name) -> None:
        """Kill the live sandbox, delete the state snapshot, forget the workspace (404 unknown, 409 busy)."""
        self._ws_row(name)
        self._ws_acquire(name, "delete")
        try:
            row = self._ws_row(name)
            if row["live_sandbox_id"] and not self._kill_quietly(row["live_sandbox_id"]):
                raise EngineFailure(f"workspace {name}: could not kill sandbox {row['live_sandbox_id']}")
            self._ws_retire(name)
            state = self.registry.get_snapshot(row["current_state_tag"]) if row["current_state_tag"] else None
            if state is not None and (state["spec"] or {}).get("workspace") == name:
                engine = self.engines.get(state["engine"])
                if engine is not None and state["handle"]:
                    engine.delete_snapshot(state["handle"])
                self.registry.delete_snapshot_renaming_references(
                    state["tag"], (state["spec"] or {}).get("engine_tag") or f"{state['tag']}@retired")
                self._emit("snapshot", "deleted", tag=state["tag"])
            self.registry.delete_workspace(name)
            self._emit("workspace", "deleted", name=name)
        finally:
            self._ws_release(name)

    def _reconcile_workspaces(self) -> dict:
        """After a restart: finish retirements, settle suspends that were cut short, mark running
        workspaces whose sandbox is gone ``stale``."""
        counts = {"workspaces_stale": 0, "workspace_suspends_finished": 0, "workspace_suspends_undone": 0}
        for ws in self.registry.list_workspaces():
            if ws["retiring"]:
                self._ws_retire(ws["name"])
        for snap in self.registry.list_snapshots():
            spec = snap["spec"] or {}
            if not spec.get("workspace_pending"):
                continue
            ws = self.registry.get_workspace(spec.get("workspace"))
            if (snap["status"] == "ready" and ws is not None and ws["status"] in ("running", "stale")
                    and ws["live_sandbox_id"] in (spec.get("branched_from"), None)
                    and self._ws_sandbox(ws) is None):
                # The state was written and the sandbox is gone since: the suspend finishes.
                state_tag = self.state_tag(ws["name"])
                previous = self.registry.get_snapshot(state_tag)
                lineage = snap["lineage"][:-1] + [state_tag]
                self._ws_commit_state(dict(ws, live_sandbox_id=spec.get("branched_from")), snap, previous, lineage,
                                      {k: v for k, v in spec.items() if k not in ("workspace_pending", "engine_tag")})
                self._ws_retire(ws["name"])
                counts["workspace_suspends_finished"] += 1
                continue
            engine = self.engines.get(snap["engine"])  # the sandbox still runs (or the write failed)
            if engine is not None:
                if snap["handle"]:
                    engine.delete_snapshot(snap["handle"])
                else:
                    engine.abandon("snap:" + snap["tag"])
            self.registry.delete_snapshot(snap["tag"])
            counts["workspace_suspends_undone"] += 1
        for ws in self.registry.list_workspaces():
            if ws["status"] == "running" and self._ws_sandbox(ws) is None:
                self._ws_mark_stale(ws)
                counts["workspaces_stale"] += 1
        return counts

    # --- lineage ---------------------------------------------------------------------------------

    def tree(self) -> list[dict]:
        """Every snapshot and live sandbox as nodes with a parent id (None for roots) and the whole
        lineage (root ... itself), so a front end can draw ancestors that are gone."""
        nodes = []
        for s in self.registry.list_snapshots():
            nodes.append({"id": s["tag"], "kind": "snapshot", "parent": s["lineage"][-2] if len(s["lineage"]) > 1 else None,
                          "status": s["status"], "pause_ms": s["pause_ms"], "created_at": s["created_at"],
                          "engine": s["engine"], "lineage": s["lineage"]})
        for b in self.registry.list_sandboxes():
            if b["status"] == "running":
                nodes.append({"id": b["id"], "kind": "sandbox", "parent": b["snapshot_tag"], "status": "running",
                              "pause_ms": None, "created_at": b["created_at"], "engine": b["engine"],
                              "lineage": b["lineage"]})
        return nodes
