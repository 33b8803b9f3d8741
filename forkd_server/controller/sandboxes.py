"""Sandboxes: spawn from a snapshot, list, kill, and talk to each one's agent.

A sandbox is running once its engine handle is recorded; one whose process ended outside our control
is dropped (and its engine leftovers released) the first time it is looked at, with a ``killed``
event that says why: a limit it died of, read before its leaves go (endings.py). The registry
remembers each end, so a later call naming the id answers 404 saying when and why it ended.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from forkd_engine import AgentUnreachable, ChildSpec, EngineError, LimitReached

from . import endings
from .checks import HOST_MEMORY, MAX_CHILDREN, check_labels, check_tag, memory_limit
from ..hub.ownership import inheritable
from ..errors import BadRequest, Busy, Conflict, EngineFailure, Gone, NotFound
from .wire import sandbox_info

if TYPE_CHECKING:
    from .controller import Controller


EXIT_WAIT = 1.0  # s an agent whose connection broke has to finish exiting before it is judged alive


def running(row: dict) -> bool:
    """A sandbox row that names a running sandbox: started, and no end under way."""
    return row["status"] == "running" and not row.get("ending")


EVAL_TIMEOUT = 300.0  # seconds an eval may take, wherever it is made (here, or on the loop: loop_calls.py)


def eval_answer(reply: dict) -> dict:
    """An eval's answer, from its agent's reply."""
    return {"result": reply.get("result"), "error": reply.get("error"), "exit_code": reply.get("exit_code", 1)}


def exec_request(args, timeout_secs, env: dict | None, cwd: str | None) -> dict:
    """An exec's request to its agent, or ``BadRequest`` saying what is wrong with it."""
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        raise BadRequest("args must be a non-empty list of strings")
    if isinstance(timeout_secs, bool) or not isinstance(timeout_secs, (int, float)) or timeout_secs <= 0:
        raise BadRequest("timeout_secs must be a positive number")
    request = {"action": "exec", "args": args, "timeout": timeout_secs}
    if env:
        request["env"] = env
    if cwd:
        request["cwd"] = cwd
    return request


def exec_timeout(request: dict) -> float:
    """How long the server waits for an exec's reply: the agent's own timeout ends the command first."""
    return request["timeout"] + 5


def exec_answer(reply: dict) -> dict:
    """An exec's answer, from its agent's reply."""
    out = {"stdout": reply.get("stdout", ""), "stderr": reply.get("stderr", ""), "exit_code": reply.get("exit_code", 1)}
    for extra in ("error", "timed_out"):
        if extra in reply:
            out[extra] = reply[extra]
    return out


def _timed_out(exc: BaseException | None) -> bool:
    """True if the agent call failed because its deadline passed (not because the agent went away)."""
    while exc is not None:
        if isinstance(exc, TimeoutError):
            return True
        exc = exc.__cause__
    return False


class SandboxManager:
    def __init__(self, controller: "Controller"):
        self.ctl = controller
        self.registry = controller.registry
        self.engines = controller.engines
        self.feed = controller.feed
        self._listing: tuple | None = None    # (registry generation, running rows, their infos)
        self._killing: set[str] = set()       # ids a kill is ending: it records their end, no one else
        self._admitting = threading.Lock()    # the cap's count and a spawn's rows, one spawn at a time

    def row(self, sandbox_id) -> dict:
        if isinstance(sandbox_id, str):
            self.ctl.recovery.check_sandbox(sandbox_id)  # 503 while a restart has not settled it
        row = self.registry.get_sandbox(sandbox_id) if isinstance(sandbox_id, str) else None
        if row is None or not running(row) or not self.alive(row):
            raise self.not_found(sandbox_id)
        return row

    def not_found(self, sandbox_id):
        """404 for ``sandbox_id``, saying when and why it ended if that is remembered."""
        ended = self.registry.ended_sandbox(sandbox_id) if isinstance(sandbox_id, str) else None
        return endings.not_found(sandbox_id, ended)

    def alive(self, row: dict) -> bool:
        """True if its process lives, or its state is in the store (tier ``stored``, tiers.py); a
        sandbox that died outside our control is dropped."""
        if row.get("tier") == "stored":
            return True
        engine = self.engines.get(row["engine"])
        if engine is not None and row["handle"] and engine.alive(row["handle"]):
            return True
        if row["id"] not in self._killing:
            self.drop(row, self.death(row))
        return False

    def death(self, row: dict) -> dict:
        """Why a sandbox whose process ended did (``endings.died``): a limit its cgroup says it hit,
        how its process ended. Read before ``drop``, which removes the cgroup and lets that go."""
        engine = self.engines.get(row["engine"])
        if engine is None or not row["handle"]:
            return endings.died(row, [])
        return endings.died(row, engine.limits_hit(row["handle"]), engine.exit_status(row["handle"]))

    def end(self, row: dict, ended: dict, remember: bool = True) -> None:
        """End a sandbox and record that it ended, in that order: the duty is recorded first (the
        row's ``ending``), the engine ends the process (or releases what a dead one held: socket,
        cgroup leaves) and only once it is gone does the row go, remembering why (``ended``). A
        crash in between leaves the duty recorded, and the next start-up finishes it (recovery.py);
        an end the engine cannot make (EngineError) leaves it too. ``remember=False``: a sandbox the
        server made for its own purposes, whose id no one asks about."""
        self.registry.update_sandbox(row["id"], ending=ended)
        engine = self.engines.get(row["engine"])
        if engine is not None and row["handle"]:
            engine.kill(row["handle"])
        leaving = None
        if engine is not None and row.get("stored"):  # its state in the store (tiers.py) goes with it
            leaving = self.ctl.stores.stored_copies.leaving(row["id"], row["stored"])  # the remote copy too
            engine.delete_snapshot(row["stored"]["handle"])
        self.registry.delete_sandboxes([row["id"]], ended=ended if remember else None)
        self.ctl.tiers.forget(row["id"])
        self.ctl.stores.stored_copies.delete_later(leaving)

    def drop(self, row: dict, ended: dict) -> None:
        """End (or release what it held) a sandbox that died or must go, remember why, and say so.
        If its process will not go, the recorded duty stays for the next start-up, and it is said."""
        try:
            self.end(row, ended)
        except EngineError as exc:
            ended = dict(ended, reason=f"{ended['reason']}; its process would not exit ({exc}): the next "
                                       f"start of the server ends it")
        self.feed.emit("sandbox", "killed", id=row["id"], reason=ended["reason"],
                       **({"limit": ended["limit_hit"]} if ended["limit_hit"] else {}),
                       **({"hint": ended["hint"]} if ended.get("hint") else {}))

    def _agent(self, sandbox_id: str, request: dict, what: str, timeout: float | None = None,
               wake: bool = True) -> dict:
        try:
            with self.ctl.tiers.call(sandbox_id, wake) as row:  # a frozen or stored sandbox wakes first
                engine = self.engines.get(row["engine"])
                return engine.call(row["handle"], request, timeout=timeout)
        except (AgentUnreachable, EngineError) as exc:
            self.agent_failed(row, exc, what)

    def agent_failed(self, row: dict, exc: EngineError, what: str) -> None:
        """Raise what a failed agent call of the sandbox ``row`` means: 410 if the sandbox ended
        during it (killed, or died: of what), else 500 saying what failed."""
        sandbox_id = row["id"]
        if not _timed_out(exc) and self.engines[row["engine"]].wait_exit(row["handle"], EXIT_WAIT):
            if sandbox_id in self._killing:  # a kill ends it: the kill records that
                ended = endings.killed(sandbox_id)
            elif self.registry.get_sandbox(sandbox_id) is not None:
                ended = self.death(row)  # it died during the call: say of what
                self.drop(row, ended)
            else:  # a kill dropped it meanwhile
                ended = self.registry.ended_sandbox(sandbox_id) or endings.died(row, [])
            raise Gone(f"sandbox {sandbox_id} ended during this {what}: {ended['reason']}", hint=ended.get("hint"),
                       details=ended.get("details"),
                       ended={"at": time.time(), "reason": ended["reason"], "limit": ended["limit_hit"]}) from exc
        raise EngineFailure(f"{what}: {exc}") from exc

    def spawn(self, snapshot_tag, n=1, *, memory_limit_mib=None, labels=None) -> list[dict]:
        """Fork ``n`` sandboxes from a snapshot, in forkd's check order. Each starts with the
        snapshot's labels (but the server's own, hub/ownership.py), updated by ``labels``."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise BadRequest(f"n must be an integer, got {n!r}")
        if n == 0:
            raise BadRequest("n must be at least 1")
        if n > MAX_CHILDREN or n < 0:
            raise BadRequest(f"n must be between 1 and {MAX_CHILDREN}")
        check_tag(snapshot_tag, "snapshot_tag")
        memory_limit_mib = memory_limit(memory_limit_mib)
        labels = check_labels(labels)
        self.ctl.recovery.check_snapshot(snapshot_tag)
        row = self.registry.get_snapshot(snapshot_tag)
        row = row and self.ctl.checked_snapshot(row)
        if row is not None and row["status"] != "ready":
            raise Conflict(f"snapshot `{snapshot_tag}` is not bootable: status={row['status']}"
                           + (f"; {row['warning']}" if row["warning"] else ""))
        if row is None:
            raise NotFound(f"snapshot {snapshot_tag} not found")
        engine = self.engines[row["engine"]]
        if memory_limit_mib is None:  # the engine's default limit, if it has one, shown as the sandbox's
            memory_limit_mib = getattr(engine, "default_memory_limit_mib", None)
        now = time.time()

        def rows_from(first: int) -> list[dict]:
            ids = [f"sb-{int(now):08x}-{(first + i) % 0x10000:04x}" for i in range(n)]
            return [{"id": sid, "snapshot_tag": snapshot_tag, "engine": row["engine"], "status": "starting",
                     "created_at": now, "lineage": row["lineage"] + [sid], "memory_limit_mib": memory_limit_mib,
                     "labels": {**inheritable(row.get("labels")), **labels}}
                    for sid in ids]

        # Two transactions a spawn: its rows 'starting' before the engine acts (so a restart ends
        # what a crash left starting), and 'running' with their handles after.
        rows = self._admit(snapshot_tag, n, rows_from)
        ids = [r["id"] for r in rows]
        try:
            handles = engine.spawn(row["handle"], [ChildSpec(id=r["id"], lineage=r["lineage"],
                                                             memory_limit_mib=memory_limit_mib) for r in rows])
        except EngineError as exc:
            self.registry.delete_sandboxes(ids)
            if isinstance(exc, LimitReached):
                raise Conflict(f"spawn from {snapshot_tag}: {exc}") from None
            raise EngineFailure(str(exc)) from exc
        self.registry.set_sandbox_handles(dict(zip(ids, handles)))
        out = [sandbox_info({**r, "status": "running", "handle": h, "branch_count": 0}) for r, h in zip(rows, handles)]
        for info in out:
            self.feed.emit("sandbox", "created", id=info["id"], snapshot_tag=snapshot_tag, status="running")
        return out

    def held(self) -> int:
        """Sandboxes this host holds: started or starting, with no end under way. Read from the
        registry's rows, asking no engine: one whose process ended unseen counts until it is looked
        at (a listing, a call about it, a spawn that meets the cap)."""
        return sum(1 for r in self.registry.sandbox_table()[1] if not r.get("ending"))

    def _admit(self, snapshot_tag: str, n: int, rows_from) -> list[dict]:
        """Insert a spawn's ``starting`` rows if all ``n`` fit under the host's cap
        (``max_sandboxes``), else refuse the whole spawn (503): never some of them. The count and the
        insert are one step, so two spawns at once cannot both take the last room."""
        cap = self.ctl.max_sandboxes
        if cap is None:
            return self.registry.insert_numbered_sandboxes(n, rows_from)
        if self.held() + n > cap:
            self.listing()  # drops sandboxes whose process ended unseen: they no longer count
        with self._admitting:
            held = self.held()
            if held + n > cap:
                raise self._full(snapshot_tag, n, held, cap)
            return self.registry.insert_numbered_sandboxes(n, rows_from)

    @staticmethod
    def _full(snapshot_tag: str, n: int, held: int, cap: int) -> Busy:
        room = max(0, cap - held)
        fits = f"spawn at most {room} here, " if room else ""
        return Busy(f"spawn of {n} from {snapshot_tag} refused: this host holds {held} sandboxes and its cap is "
                    f"{cap} (--max-sandboxes); nothing was started",
                    hint=f"kill sandboxes you no longer need, {fits}or spawn on another host",
                    capacity={"sandboxes": held, "max_sandboxes": cap, "requested": n},
                    details={"room": room, "setting": "forkd serve --max-sandboxes N (c.ForkdApp.max_sandboxes)",
                             "rest": "DELETE /v1/sandboxes/{id}", "cli": "forkd kill ID", "magic": "%forkd kill ID"})

    def update(self, sandbox_id, *, labels=None, remove_labels=(), memory_limit_mib=None) -> dict:
        """Change a running sandbox: ``labels`` are added to its own (as a spawn adds them to its
        snapshot's), the keys ``remove_labels`` taken off (a router closing a fork tree that spans
        hosts takes ``fork_tree_id`` off so: fleet/promotes.py), and its memory limit is raised to
        ``memory_limit_mib``, never lowered (below what it holds, the kernel would reclaim its
        memory or kill it). The forkd kernel does both when a notebook checks a sandbox out: it
        becomes the notebook's."""
        labels = check_labels(labels)
        at_least = memory_limit_mib == HOST_MEMORY  # all of this host's: raised to it unless it has it
        memory_limit_mib = memory_limit(memory_limit_mib)
        row = self.row(sandbox_id)
        fields: dict = {}
        if labels or remove_labels:
            merged = {k: v for k, v in {**(row.get("labels") or {}), **labels}.items() if k not in remove_labels}
            fields["labels"] = check_labels(merged, f"the labels of {row['id']} with these")
        current = row["memory_limit_mib"]
        if at_least and current is not None and current >= memory_limit_mib:
            memory_limit_mib = current
        if memory_limit_mib is not None and memory_limit_mib != current:
            if current is None:
                raise Conflict(f"sandbox {row['id']} has no memory limit to raise: it runs without one")
            if memory_limit_mib < current:
                raise Conflict(f"the memory limit of sandbox {row['id']} ({current} MiB) can only be raised",
                               hint=f"spawn a sandbox with {memory_limit_mib} MiB instead",
                               details={"why": "under what the sandbox holds, the kernel would reclaim its memory "
                                               "or kill it"})
            row = self.ctl.tiers.running_row(sandbox_id)  # a stored sandbox has no process to raise it of
            handle = dict(row["handle"])
            try:
                self.engines[row["engine"]].raise_memory_limit(handle, memory_limit_mib)
            except EngineError as exc:
                raise EngineFailure(str(exc)) from exc
            fields.update(memory_limit_mib=memory_limit_mib, handle=handle)
        if fields:
            self.registry.update_sandbox(row["id"], **fields)
            self.feed.emit("sandbox", "updated", id=row["id"],
                           **{k: fields[k] for k in ("labels", "memory_limit_mib") if k in fields})
        return sandbox_info(self.registry.get_sandbox(row["id"]))

    def list(self) -> list[dict]:
        _gen, infos, live = self.listing()
        return [dict(info) for info, ok in zip(infos, live) if ok]

    def listing(self) -> tuple[int, list[dict], list[bool]]:
        """(generation, infos, alive) of every running sandbox: ``infos`` are shared and read-only
        and stay the same objects while ``generation`` does (the registry did not change), so a
        caller may cache what it derives from them; ``alive`` is checked on every call."""
        gen, rows = self.registry.sandbox_table()
        listing = self._listing
        if listing is None or listing[0] != gen:
            live = [r for r in rows if running(r)]
            listing = self._listing = (gen, live, [sandbox_info(r) for r in live])
        _gen, live, infos = listing
        alive = self._alive_many(live)
        settling = self.ctl.recovery.sandboxes  # not listed until a restart has settled them
        return gen, infos, [r["id"] not in settling and (alive[r["id"]] or self.alive(r)) for r in live]

    def _alive_many(self, rows: list[dict]) -> dict[str, bool]:
        """Liveness of many sandboxes, asking each engine once when it can answer in bulk."""
        out: dict[str, bool] = {}
        for name, engine in self.engines.items():
            mine = [r for r in rows if r["engine"] == name and r["handle"]]
            bulk = getattr(engine, "alive_many", None)
            flags = bulk([r["handle"] for r in mine]) if bulk else [engine.alive(r["handle"]) for r in mine]
            out.update((r["id"], f) for r, f in zip(mine, flags))
        return {r["id"]: out.get(r["id"], False) for r in rows}

    def get(self, sandbox_id) -> dict:
        return sandbox_info(self.row(sandbox_id))

    def kill(self, sandbox_id, ended: dict | None = None) -> None:
        """Kill a sandbox; answered once its process is gone (a kill that did not finish, here or
        before a crash, is finished by the next kill of the id, or by the next start-up). ``ended``:
        why, as its 404 will say it (default: killed by DELETE)."""
        if isinstance(sandbox_id, str):
            self.ctl.recovery.check_sandbox(sandbox_id)
        row = self.registry.get_sandbox(sandbox_id) if isinstance(sandbox_id, str) else None
        if row is None or not row.get("ending"):
            row = self.row(sandbox_id)
        self._killing.add(row["id"])
        try:
            self.end(row, row.get("ending") or ended or endings.killed(row["id"]))
        except EngineError as exc:
            raise EngineFailure(f"sandbox {row['id']} was killed but its process has not exited: {exc}",
                                hint="DELETE it again; a restart of the server also finishes the kill") from exc
        finally:
            self._killing.discard(row["id"])
        self.feed.emit("sandbox", "killed", id=row["id"])

    def memory(self, sandbox_id) -> dict:
        row = self.row(sandbox_id)
        if row.get("tier") == "stored":  # no process, no RAM: its state is in the store
            return {"rss_kib": 0, "pss_kib": 0, "uss_kib": 0, "tier": "stored"}
        return self.engines[row["engine"]].memory(row["handle"])

    # --- talking to the agent --------------------------------------------------------------------

    def engine_of(self, sandbox_id) -> tuple:
        """(engine, handle) of a running sandbox, for managers that talk to its agent (404 if none);
        a frozen or stored one is woken first."""
        row = self.ctl.tiers.running_row(sandbox_id)
        return self.engines[row["engine"]], row["handle"]

    def interrupt(self, sandbox_id) -> dict:
        """Raise KeyboardInterrupt in the cell the sandbox is running (``interrupted``: was there one)."""
        return self._agent(sandbox_id, {"action": "interrupt"}, "interrupt", timeout=5)

    def inventory(self, sandbox_id) -> dict:
        """What a branch of the sandbox now would not carry (empty where the engine carries all)."""
        row = self.ctl.tiers.running_row(sandbox_id)
        try:
            lost = self.engines[row["engine"]].inventory(row["handle"])
        except (AgentUnreachable, EngineError) as exc:
            raise EngineFailure(f"inventory: {exc}") from exc
        return {"id": row["id"], "engine": row["engine"], "lost": lost}

    def ping(self, sandbox_id, timeout: float = 5.0, wake: bool = True) -> dict:
        """``wake=False``: ``NotRunning`` (409) for a frozen or stored sandbox, which stays so."""
        return self._agent(sandbox_id, {"action": "ping"}, "ping", timeout=timeout, wake=wake)

    def exec(self, sandbox_id, args, timeout_secs: float = 30, env: dict | None = None, cwd: str | None = None) -> dict:
        self.row(sandbox_id)
        request = exec_request(args, timeout_secs, env, cwd)
        return exec_answer(self._agent(sandbox_id, request, "exec", timeout=exec_timeout(request)))

    def eval(self, sandbox_id, code) -> dict:
        self.row(sandbox_id)
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        return eval_answer(self._agent(sandbox_id, {"action": "eval", "code": code}, "eval", timeout=EVAL_TIMEOUT))

    def run_code(self, sandbox_id, code, timeout: float = 600) -> dict:
        self.row(sandbox_id)
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        try:
            # queue_wait: a cell the agent cannot start soon (a kernel's cell holds its main thread)
            # is refused as busy before the deadline, so a deadline always finds our own cell running.
            reply = self._agent(sandbox_id, {"action": "run_code", "code": code, "queue_wait": min(10.0, timeout / 2)},
                                "run_code", timeout=timeout)
            if reply.get("busy"):  # its main thread runs something else (a kernel's cell)
                raise Conflict(f"{reply.get('error')} (POST /v1/sandboxes/{sandbox_id}/interrupt stops it)")
            return reply
        except EngineFailure as exc:
            if not _timed_out(exc):
                raise
        # The caller's own deadline passed: stop the cell (so the sandbox is free again) and say so,
        # as exec says timed_out; nothing the cell printed reaches this reply.
        interrupted = False
        try:
            interrupted = bool(self.interrupt(sandbox_id).get("interrupted"))
        except EngineFailure:
            pass
        return {"stdout": "", "stderr": "", "outputs": [], "result": None, "exit_code": 1, "timed_out": True,
                "error": {"ename": "TimeoutError", "traceback": [],
                          "evalue": f"the cell ran past its timeout of {timeout:g} s"
                                    + (" and was interrupted" if interrupted else
                                       "; it could not be interrupted: it may still run (kill the sandbox)")}}

    def files(self, sandbox_id, op: str, path, **options) -> dict:
        self.row(sandbox_id)
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

    def kill_quietly(self, sandbox_id: str) -> bool:
        """Kill a sandbox we started for our own purposes; True when it is gone (or was already)."""
        row = self.registry.get_sandbox(sandbox_id)
        if row is None:
            return True
        try:
            self.end(row, row.get("ending") or endings.killed(sandbox_id), remember=False)
        except Exception:  # noqa: BLE001 - the caller's result stands; the recorded duty is finished later
            return False
        self.feed.emit("sandbox", "killed", id=sandbox_id)
        return True
