"""Tiers: a sandbox is ``running``, ``frozen`` (paused: its memory kept, no CPU used) or ``stored``
(its state a snapshot in the store: no process, no RAM), and the next call wakes it.

- *freeze*: the engine pauses every process (the process engine's cgroup freezer) or vCPU (the VM
  engine's QMP ``stop``); waking is a thaw, milliseconds.
- *store* (VM engine only): the sandbox is branched (mode full) into a snapshot of its own, named
  ``<id>@stored-<n>`` (``@`` is in no user tag, so it never meets one), kept in the local chunk
  store and pushed to the remote store when the server has one; then its QEMU ends and the
  snapshot's RAM file leaves tmpfs. Waking fetches what the local store lacks, writes the RAM file
  back, and restores a VM under the *same* sandbox id, so callers never see the change; then the
  stored state goes, here and from the remote store (stored_copies.py). A process
  sandbox is a process, which cannot be written as files: ``frozen`` is its deepest tier.

The state is recorded in the sandbox's row (``tier``, and ``stored``: the snapshot's handle and
digest) before the old process ends, and the handle of the new one before its stored state goes,
so a crash at any point leaves a sandbox that is still running, or still stored and wakeable
(recovery.py settles either). One lock per sandbox orders the moves; a call waits on it for a wake
under way (``WAKE_WAIT``) and then gets a 503 saying so, never a 500. A move down is refused (409)
while a call runs in the sandbox: a frozen agent would leave that call hanging. It first waits a
moment (``CALLS_RETURN``) for calls under way to return: the pings of a panel's or a widget's
re-read are calls too, and a freeze must not fail because one was in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Iterator

from forkd_engine import ChildSpec, EngineError
from forkd_engine.store import StoreError, fetch_manifest, push as push_chunks

from ..errors import Busy, Conflict, EngineFailure, StoreFailure
from .sandboxes import running
from .wire import sandbox_info

if TYPE_CHECKING:
    from .controller import Controller

TIERS = ("running", "frozen", "stored")
WAKE_WAIT = 120.0    # s a call waits for another move of its sandbox (a wake from the store) to finish
STORE_WAIT = 600.0   # s the branch a store makes has to be written
CALLS_RETURN = 1.0   # s a move down waits for the calls under way in its sandbox to return


def tier_of(row: dict) -> str:
    return row.get("tier") or "running"


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


class NotRunning(Conflict):
    """A call that may not wake its sandbox found it frozen or stored."""


class TierManager:
    def __init__(self, controller: "Controller"):
        self.ctl = controller
        self.registry = controller.registry
        self.feed = controller.feed
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._moving: dict[str, str] = {}   # id -> the move holding its lock ("a wake from stored", ...)
        self._calls: dict[str, int] = {}    # id -> calls running in it now
        self._returned = threading.Condition(self._guard)  # notified as a call leaves

    # --- the lock of one sandbox -----------------------------------------------------------------

    @contextlib.contextmanager
    def _holding(self, sandbox_id: str, move: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(sandbox_id, threading.Lock())
        if not lock.acquire(timeout=WAKE_WAIT):
            raise Busy(f"sandbox {sandbox_id} is busy with {self._moving.get(sandbox_id, 'a move between tiers')} "
                       f"for more than {WAKE_WAIT:g} s", hint="retry in a moment")
        self._moving[sandbox_id] = move
        try:
            yield
        finally:
            self._moving.pop(sandbox_id, None)
            lock.release()

    def forget(self, sandbox_id: str) -> None:
        """The sandbox ended: drop its lock (unless a move holds it, which then finds it gone)."""
        with self._guard:
            lock = self._locks.get(sandbox_id)
            if lock is not None and not lock.locked():
                del self._locks[sandbox_id]

    # --- calls: the sandbox running while they run -----------------------------------------------

    def running_row(self, sandbox_id) -> dict:
        """The row of a sandbox made ``running`` first if it was not (a wake)."""
        row = self.ctl.sandboxes.row(sandbox_id)
        if tier_of(row) == "running":
            return row
        with self._holding(row["id"], "a wake"):
            row = self.ctl.sandboxes.row(sandbox_id)
            if tier_of(row) != "running":
                row, _ = self._wake(row)
            return row

    @contextlib.contextmanager
    def call(self, sandbox_id, wake: bool = True) -> Iterator[dict]:
        """One call to a sandbox's agent: woken first, and kept from moving down until it returns.
        Counted under the sandbox's lock, so a move down either sees the call or happens before it
        (and the call then wakes it). ``wake=False``: a sandbox not running is ``NotRunning``
        instead (a look that must not undo a move down: the tree's busy column)."""
        row = self.ctl.sandboxes.row(sandbox_id)
        sid = row["id"]
        with self._holding(sid, "a wake"):
            now = self.registry.get_sandbox(sid)  # a move may have happened before we held the lock
            if now is None or tier_of(now) != "running" or now["handle"] != row["handle"]:
                row = self.ctl.sandboxes.row(sandbox_id)
                if tier_of(row) != "running":
                    if not wake:
                        raise NotRunning(f"sandbox {sid} is {tier_of(row)}: not woken for this call")
                    row, _ = self._wake(row)
            with self._guard:
                self._calls[sid] = self._calls.get(sid, 0) + 1
        try:
            yield row
        finally:
            self.leave(sid)

    def enter_now(self, sandbox_id: str) -> dict | None:
        """``call``'s way in for the event loop, taking nothing it would wait for: the row of a
        running sandbox, its call counted (``leave`` ends it). ``BlockingIOError`` where ``call``
        would wait (a move holds the sandbox's lock, another thread the registry or the liveness
        check); None where it would do more than count (a sandbox unknown, ending, not ``running``,
        or dead: ``call`` wakes it, or says why) or could not tell without waiting (an engine with no
        ``alive_many``: the VM engine's). A running sandbox's first call makes its lock, as
        ``call`` would (a spawn's first ping comes here). 503 while a restart has not settled the
        sandbox, as ``call``. The row is the registry's shared one (``Registry.shared_sandbox``):
        read it, never change it."""
        self.ctl.recovery.check_sandbox(sandbox_id)
        with self._guard:
            lock = self._locks.get(sandbox_id)
        if lock is None:
            row = self.registry.shared_sandbox(sandbox_id)
            if row is None or row["id"] != sandbox_id or not running(row):
                return None  # unknown, named otherwise or ended: ``call`` says why
            with self._guard:
                lock = self._locks.setdefault(sandbox_id, threading.Lock())
        if not lock.acquire(blocking=False):
            raise BlockingIOError(f"sandbox {sandbox_id} is held by {self._moving.get(sandbox_id, 'a move')}")
        try:  # read under the lock: a move that held it before has left its row as it is now
            row = self.registry.shared_sandbox(sandbox_id)
            if row is None or not running(row) or tier_of(row) != "running":
                return None
            engine = self.ctl.engines.get(row["engine"])
            alive_many = getattr(engine, "alive_many", None)  # the VM engine has none that never waits
            if alive_many is None or not alive_many([row["handle"]], block=False)[0]:
                return None
            with self._guard:
                self._calls[sandbox_id] = self._calls.get(sandbox_id, 0) + 1
            return row
        finally:
            lock.release()

    def leave(self, sandbox_id: str) -> None:
        """A call counted by ``call`` or ``enter_now`` returned."""
        with self._guard:
            left = self._calls.get(sandbox_id, 1) - 1
            if left:
                self._calls[sandbox_id] = left
            else:
                self._calls.pop(sandbox_id, None)
                self._returned.notify_all()

    def _idle(self, row: dict, move: str) -> None:
        """409 unless the sandbox is idle: no call of ours in it once ``CALLS_RETURN`` has passed (the
        caller holds its lock, so no new one starts), and its main thread runs nothing (its ping
        says so: a cell of a streaming session counts too)."""
        with self._guard:
            returned = self._returned.wait_for(lambda: not self._calls.get(row["id"]), timeout=CALLS_RETURN)
        busy = None if returned else "a call"
        if busy is None:
            try:
                busy = self.ctl.engines[row["engine"]].call(row["handle"], {"action": "ping"}, timeout=5).get("busy")
            except EngineError:
                busy = None  # an agent that does not answer runs nothing we could cut short
        if busy:
            raise Conflict(f"sandbox {row['id']} is running {busy}; it can {move} once that has returned",
                           hint=f"retry when it is idle, or interrupt it (POST /v1/sandboxes/{row['id']}/interrupt)",
                           details={"mcp": "retry once the call running in it has returned (cancelling a run_cell "
                                           "interrupts its cell)"})

    # --- the moves -------------------------------------------------------------------------------

    def freeze(self, sandbox_id) -> dict:
        """Pause a running sandbox (its memory kept, no CPU): tier ``frozen``. A frozen one is
        answered as it is; a stored one is deeper already (409)."""
        row = self.ctl.sandboxes.row(sandbox_id)
        with self._holding(row["id"], "a freeze"):
            row = self.ctl.sandboxes.row(sandbox_id)
            tier = tier_of(row)
            if tier == "stored":
                raise Conflict(f"sandbox {row['id']} is stored, a deeper tier than frozen",
                               hint=f"wake it first (POST /v1/sandboxes/{row['id']}/wake)",
                               details={"mcp": f"wake_sandbox {row['id']} first"})
            if tier == "running":
                self._idle(row, "freeze")
                try:
                    self.ctl.engines[row["engine"]].freeze(row["handle"])
                except EngineError as exc:
                    raise EngineFailure(f"freeze of {row['id']}: {exc}") from exc
                self._set(row["id"], "frozen")
            return sandbox_info(self.registry.get_sandbox(row["id"]))

    def store(self, sandbox_id) -> dict:
        """Write a VM sandbox's state into the store and end its QEMU: tier ``stored``. 409 on the
        process engine, whose deepest tier is frozen."""
        row = self.ctl.sandboxes.row(sandbox_id)
        engine = self.ctl.engines[row["engine"]]
        if not hasattr(engine, "store_snapshot"):
            raise Conflict(f"sandbox {row['id']} runs on the {row['engine']} engine, whose deepest tier is frozen: "
                           f"a process cannot be written as files",
                           hint=f"freeze it instead (POST /v1/sandboxes/{row['id']}/freeze), or run sandboxes that "
                                f"can be stored on the vm engine",
                           details={"rest": f"POST /v1/sandboxes/{row['id']}/freeze", "sdk": "sandbox.freeze()",
                                    "cli": f"forkd freeze {row['id']}",
                                    "mcp": f"freeze_sandbox {row['id']} instead, or store sandboxes of a snapshot "
                                           f"made with create_snapshot engine='vm'",
                                    "vm": "snapshots created with engine vm (forkd serve, c.ForkdApp) store their "
                                          "sandboxes"})
        with self._holding(row["id"], "a store"):
            row = self.ctl.sandboxes.row(sandbox_id)
            if tier_of(row) == "stored":
                return sandbox_info(row)
            self._idle(row, "be stored")
            if tier_of(row) == "frozen":  # a branch runs the VM's own stop and resume
                try:
                    engine.thaw(row["handle"])
                except EngineError as exc:
                    raise EngineFailure(f"store of {row['id']}: {exc}") from exc
                self._set(row["id"], None)
            return sandbox_info(self._store(row, engine))

    def _store(self, row: dict, engine) -> dict:
        tag = f"{row['id']}@stored-{self.registry.next_counter('stored:' + row['id'])}"
        release = self.ctl.branches.take_slot(tag)
        snap = None
        try:
            try:
                result = engine.branch(row["handle"], tag, row["lineage"] + [tag], "full")
                snap = result.ready.result(timeout=STORE_WAIT)
                digest = engine.store_snapshot(snap)
            except (EngineError, TimeoutError) as exc:
                raise EngineFailure(f"store of {row['id']}: {exc}") from exc
            remote = self.ctl.stores.remote
            if remote is not None:
                try:
                    push_chunks(engine.store, remote, digest, held=self.ctl.stores.held_remotely(engine))
                except StoreError as exc:
                    raise StoreFailure(f"store of {row['id']}: {exc}",
                                       hint="the sandbox runs on; store it again once the store answers") from None
            stored = {"handle": snap, "digest": digest, "remote": remote is not None,
                      **({"store": remote.url} if remote is not None else {})}
            # Recorded before the VM ends: from here a crash leaves it stored (recovery ends the VM).
            self.registry.update_sandbox(row["id"], tier="stored", stored=stored)
        except BaseException:
            if snap is not None:
                with contextlib.suppress(Exception):
                    engine.delete_snapshot(snap)
            raise
        finally:
            release()
        self.retire_process(row, engine)
        engine.release_files(snap)  # its RAM file leaves tmpfs: the store holds it
        self.feed.emit("sandbox", "tier", id=row["id"], tier="stored", digest=digest)
        return self.registry.get_sandbox(row["id"])

    def retire_process(self, row: dict, engine) -> None:
        """End the process of a sandbox now stored, and forget its handle (recovery finishes this)."""
        if row["handle"]:
            try:
                engine.kill(row["handle"])
            except EngineError as exc:
                raise EngineFailure(f"sandbox {row['id']} is stored, but its QEMU did not exit: {exc}",
                                    hint="a restart of the server ends it") from exc
            self.registry.update_sandbox(row["id"], handle=None)

    def wake(self, sandbox_id) -> dict:
        """Make a sandbox running again, its state intact: SandboxInfo plus ``wake``, the time it
        took (``ms``) and, from stored, its split (``fetch_ms``, ``decompress_ms``, ``restore_ms``)."""
        row = self.ctl.sandboxes.row(sandbox_id)
        with self._holding(row["id"], "a wake"):
            row = self.ctl.sandboxes.row(sandbox_id)
            row, figures = self._wake(row) if tier_of(row) != "running" else (row, {"from": "running", "ms": 0.0})
            return {**sandbox_info(row), "wake": figures}

    def _wake(self, row: dict) -> tuple[dict, dict]:
        """(the running row, the wake's figures); the caller holds the sandbox's lock."""
        engine = self.ctl.engines[row["engine"]]
        t0 = time.perf_counter()
        tier = tier_of(row)
        if tier == "frozen":
            try:
                engine.thaw(row["handle"])
            except EngineError as exc:
                raise EngineFailure(f"wake of {row['id']}: {exc}") from exc
            self._set(row["id"], None)
            figures = {"from": "frozen", "ms": _ms(t0)}
        else:
            figures = self._restore(row, engine, t0)
        self.feed.emit("sandbox", "tier", id=row["id"], tier="running", wake_ms=figures["ms"])
        return self.registry.get_sandbox(row["id"]), figures

    def _restore(self, row: dict, engine, t0: float) -> dict:
        stored = row["stored"]
        snap = stored["handle"]
        if row["handle"]:  # a store cut short after its record: its VM still runs
            self.retire_process(row, engine)
        manifest, remote = engine.store.get_manifest(stored["digest"]), None
        if manifest is None or not engine.store.has_all(manifest):
            remote = self.ctl.stores.remote
            if remote is None or not stored.get("remote"):
                raise EngineFailure(f"wake of {row['id']}: its stored state {stored['digest']} is gone from the local "
                                    f"store {engine.store.root}" + ("" if remote else " and no remote store is set"))
        try:
            manifest = manifest or fetch_manifest(remote, digest=stored["digest"])
            manifest_ms = _ms(t0)
            # one pass: each chunk the local store lacks is fetched, verified, written into the RAM
            # file and kept, decompressed once
            files = engine.materialise(snap, manifest, remote) or {}
            if remote is not None:
                engine.store.pin(snap["tag"], stored["digest"])
            t2 = time.perf_counter()
            handle = engine.spawn(snap, [ChildSpec(id=row["id"], lineage=row["lineage"],
                                                   memory_limit_mib=row["memory_limit_mib"], wake=True)])[0]
        except StoreError as exc:
            raise StoreFailure(f"wake of {row['id']}: {exc}", hint="it stays stored; retry once the store "
                                                                  "answers") from None
        except EngineError as exc:
            raise EngineFailure(f"wake of {row['id']}: {exc}", hint="it stays stored; retry the call") from exc
        restore_ms = _ms(t2)
        copies = self.ctl.stores.stored_copies
        leaving = copies.leaving(row["id"], stored)  # its remote copy goes too, once it is recorded running
        # Recorded before the stored state goes: a crash from here leaves it running.
        self.registry.update_sandbox(row["id"], handle=handle, tier=None, stored=None)
        with contextlib.suppress(Exception):  # its chunks become cache (pinned no more)
            engine.delete_snapshot(snap)
        copies.delete_later(leaving)
        return {"from": "stored", "ms": _ms(t0), "fetch_ms": round(manifest_ms + files.get("fetch_ms", 0.0), 1),
                "fetched_bytes": files.get("fetched_bytes", 0), "decompress_ms": files.get("decompress_ms", 0.0),
                "restore_ms": restore_ms}

    def _set(self, sandbox_id: str, tier: str | None) -> None:
        self.registry.update_sandbox(sandbox_id, tier=tier)
        if tier is not None:
            self.feed.emit("sandbox", "tier", id=sandbox_id, tier=tier)

    # --- start-up ----------------------------------------------------------------------------------

    def stored_handles(self) -> list[dict]:
        """The handles of every stored sandbox's state snapshot (what an engine's sweep must keep)."""
        return [r["stored"]["handle"] for r in self.registry.list_sandboxes() if r.get("stored")]

    def settle_stored(self, row: dict) -> str | None:
        """At start-up, a stored sandbox: end a VM a store cut short left running; None when its
        stored state is whole, else why not."""
        engine = self.ctl.engines[row["engine"]]
        if row["handle"]:
            self.retire_process(row, engine)
        snap = (row.get("stored") or {}).get("handle")
        if not snap or not engine.alive(snap):
            return "its stored state is gone (no files, and the local store holds no copy)"
        return None
