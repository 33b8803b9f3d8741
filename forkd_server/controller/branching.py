"""Branch slots and the writing -> ready life of a snapshot written from a running sandbox.

A branch holds one of ``cap`` concurrency slots from the moment it is accepted until its snapshot is
``ready`` or ``failed`` (forkd's cap: 503 beyond it). A tag being written, by a branch, a create or
a workspace suspend, is *in flight*, so a second writer of it is 409. ``branch_into`` records the
new snapshot as ``writing``, asks the engine, and marks it ``ready`` or ``failed`` when the engine's
completion resolves, giving the slot back then. That final record never leaves a snapshot
``writing`` (``settle``): one the registry refuses (a full disk) makes the snapshot ``failed``, its
template ended, and is written as soon as the registry takes it. Used by the controller (branch, compact) and the
workspace manager (suspend).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterator

from forkd_engine import AgentUnreachable, EngineError, LimitReached, LossyFork, UnsupportedMode

from .changes import ChangeFeed
from ..errors import BadRequest, Busy, Conflict, EngineFailure, ForkdError, NotFound
from ..hub.ownership import inheritable
from .registry import Registry
from .wire import FORK_TREE_LABEL, pause_fields

SETTLE_RETRY = 5.0  # s between writes of a snapshot's final record that the registry refused
READY_TIMEOUT = 600.0  # a waiting branch gives up on the engine's completion after this long


def lossy_refusal(exc: LossyFork, what: str, magic: str | None = "%forkd branch --lossy") -> Conflict:
    """409: what a fork would lose, and the two ways out (``magic``: the lossy way in a notebook, if any)."""
    items = list(exc.items)
    shown = "; ".join(items[:3]) + (f" (and {len(items) - 3} more)" if len(items) > 3 else "")
    return Conflict(f"{what} would lose what a fork() cannot carry: {shown}",
                    hint="use the VM engine, which carries it, or fork anyway with a lossy fork",
                    details={"lost": items, "lossy": "a lossy fork's snapshot lists what it lost as warnings",
                             "rest": '"lossy": true', "sdk": "lossy=True",
                             **({"magic": magic} if magic else {}), "cli": "forkd snapshot --lossy",
                             "vm": 'engine "vm" copies the whole machine: threads, processes and sockets included'},
                    lost=items)


def inherited_labels(row: dict) -> dict:
    """The labels a branch of sandbox ``row`` keeps: all but its fork tree's, which names the members
    of that tree only (forktrees.py), and the server's own (hub/ownership.py)."""
    return {k: v for k, v in inheritable(row.get("labels")).items() if k != FORK_TREE_LABEL}


class BranchManager:
    def __init__(self, registry: Registry, engines: dict, feed: ChangeFeed, cap: int):
        if cap < 1:
            raise ValueError("branch_concurrency must be at least 1")
        self.registry, self.engines, self.feed, self.cap = registry, engines, feed, cap
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()  # tags being written (create, branch, suspend)
        self._slots = 0                    # branches holding a concurrency slot
        self._unsettled: dict[str, dict] = {}  # tag -> the final record the registry refused, until it takes it
        self.unsettled_idle = threading.Event()  # set when no refused record waits for a retry (and none runs)
        self.unsettled_idle.set()
        self.on_ready: Callable[[str], None] | None = None  # told each snapshot that becomes ready

    @property
    def slots_in_use(self) -> int:
        return self._slots

    @property
    def in_flight(self) -> frozenset[str]:
        """The tags being written right now."""
        with self._lock:
            return frozenset(self._in_flight)

    @contextlib.contextmanager
    def reserve(self, tag: str, conflict: str) -> Iterator[None]:
        """Hold ``tag`` as in flight, without a slot (a create, a suspend's final tag): 409
        ``conflict`` if somebody is writing it already."""
        with self._lock:
            if tag in self._in_flight:
                raise Conflict(conflict)
            self._in_flight.add(tag)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.discard(tag)

    def take_slot(self, tag: str) -> Callable[[], None]:
        """Reserve a branch concurrency slot for writing ``tag``: 409 if ``tag`` is in flight, 503 at
        the cap. Returns the release (idempotent; ``branch_into`` calls it when the write ends)."""
        with self._lock:
            if tag in self._in_flight:
                raise Conflict(f"a branch to {tag} is already in flight")
            if self._slots >= self.cap:
                raise Busy(f"branch concurrency limit reached ({self.cap} in flight); retry shortly")
            self._in_flight.add(tag)
            self._slots += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._in_flight.discard(tag)
                    self._slots -= 1

        return release

    def branch_into(self, row: dict, tag: str, mode: str, release: Callable[[], None], *, wait: bool = True,
                    lineage: list[str] | None = None, branched_from: str | None = None, spec: dict | None = None,
                    record_pause: bool = True, lossy: bool = False, labels: dict | None = None) -> dict:
        """Branch the running sandbox ``row`` into snapshot ``tag`` while holding the slot ``release``
        frees: the slot goes back when the snapshot is ready or failed, or at once on an error.
        The snapshot keeps the sandbox's labels (but its fork tree's and the server's own), updated by ``labels``; with ``lossy`` a fork that
        loses running work goes ahead and the snapshot keeps what was lost as ``warnings``.
        Returns the snapshot's registry row (``writing`` with ``wait=False``)."""
        try:
            engine = self.engines[row["engine"]]
            lineage = lineage or row["lineage"] + [tag]
            branched_from = branched_from or row["id"]
            # A snapshot that is a process dies with the host: its record need not wait for the disk.
            durable = not getattr(engine, "snapshots_are_processes", False)
            self.registry.insert_snapshot({
                "tag": tag, "engine": row["engine"], "status": "writing", "created_at": time.time(),
                "branched_from": branched_from, "lineage": lineage,
                "spec": spec or {"branched_from": row["id"], "mode": mode},
                "labels": {**inherited_labels(row), **(labels or {})}}, durable=durable)
            try:
                result = engine.branch(row["handle"], tag, lineage, mode, lossy=lossy)
            except BaseException as exc:  # nothing was written: no row, and the slot goes back
                self.registry.delete_snapshot(tag)
                if isinstance(exc, LossyFork):
                    raise lossy_refusal(exc, f"branch of {row['id']}") from None
                if isinstance(exc, LimitReached):
                    raise Conflict(f"branch of {row['id']}: {exc}") from None
                if isinstance(exc, UnsupportedMode):  # valid request, impossible here: a 4xx naming why
                    raise BadRequest(f"branch: {exc}") from exc
                if isinstance(exc, (EngineError, AgentUnreachable)):
                    raise EngineFailure(f"branch: {exc}") from exc
                raise
            if record_pause:
                self.registry.update_snapshot(tag, pause_ms=result.pause_ms, prepare_ms=result.prepare_ms,
                                              durable=durable)
            if result.warnings:
                self.registry.update_snapshot(tag, warnings=list(result.warnings), durable=durable)
            self.registry.update_sandbox(row["id"], branch_count=row["branch_count"] + 1, durable=durable)
            self.feed.emit("snapshot", "created", tag=tag, status="writing", branched_from=branched_from,
                           **(pause_fields(result.pause_ms) if record_pause else {}),
                           **({"warnings": list(result.warnings)} if result.warnings else {}))

            settled = threading.Event()
            unrecorded: list[BaseException] = []

            def complete(future) -> None:
                try:
                    fields = {"status": "ready", "handle": future.result()}
                except BaseException as exc:  # noqa: BLE001
                    fields = {"status": "failed", "warning": f"branch failed: {exc}"}
                try:
                    fields, error = self.settle(tag, fields, engine)
                    if error is not None:
                        unrecorded.append(error)
                finally:
                    release()
                    settled.set()
                self.feed.emit("snapshot", "status", tag=tag, status=fields["status"],
                               **({"warning": fields["warning"]} if "warning" in fields else {}))

            result.ready.add_done_callback(complete)
            if wait:
                try:
                    result.ready.result(timeout=READY_TIMEOUT)
                except FutureTimeout:
                    raise EngineFailure(f"branch {tag} did not become ready within {READY_TIMEOUT:g} s") from None
                except EngineError as exc:
                    raise EngineFailure(f"branch: {exc}") from exc
                settled.wait()  # the done-callback may still be running in the engine's thread
                if unrecorded:
                    raise EngineFailure(f"branch {tag}: the snapshot was written but its record could not be "
                                        f"({unrecorded[0]}); it is failed") from unrecorded[0]
            return self.overlay(self.registry.get_snapshot(tag))
        except BaseException:
            written = self.registry.get_snapshot(tag)
            if written is None or written["status"] != "writing":
                release()
            raise

    # --- the final record of a write --------------------------------------------------------------

    def settle(self, tag: str, fields: dict, engine) -> tuple[dict, BaseException | None]:
        """Record how the write of snapshot ``tag`` ended: ``fields`` is ``ready`` with its handle, or
        ``failed`` with a warning. It never stays ``writing``: if the registry refuses the record (a
        full disk), a ready snapshot's template is ended (nothing runs that no record names) and the
        snapshot is failed, saying why, in the registry as soon as it takes a write (retried every
        ``SETTLE_RETRY`` s) and in every read meanwhile (``overlay``).
        Returns (the fields that stand, the registry's error or None)."""
        try:
            self.registry.update_snapshot(tag, durable=not getattr(engine, "snapshots_are_processes", False),
                                          **fields)
        except Exception as exc:  # noqa: BLE001 - sqlite3 or OS: the disk, most likely; said below
            error = exc
        else:
            if fields["status"] == "ready" and self.on_ready is not None:
                self.on_ready(tag)  # kept in the local store, off the caller's path (stores.py)
            return fields, None
        if fields["status"] == "ready":
            with contextlib.suppress(Exception):
                engine.delete_snapshot(fields["handle"])
            fields = {"status": "failed", "warning": f"snapshot is not bootable: it was written but its record "
                                                     f"could not be ({error}), so its template was ended"}
        try:
            self.registry.update_snapshot(tag, **fields)
        except Exception:  # noqa: BLE001 - the same refusal: retried until the registry takes it
            with self._lock:
                self._unsettled[tag] = fields
                start = self.unsettled_idle.is_set()  # no retry thread runs: start one
                self.unsettled_idle.clear()
            if start:
                threading.Thread(target=self._retry_unsettled, name="forkd-settle", daemon=True).start()
        return fields, error

    def overlay(self, row: dict | None) -> dict | None:
        """A snapshot row as it stands: a write whose final record the registry refused reads as the
        ``failed`` it is, not ``writing``."""
        if row is None or row["status"] != "writing":
            return row
        with self._lock:
            fields = self._unsettled.get(row["tag"])
        return dict(row, **fields) if fields else row

    def _retry_unsettled(self) -> None:
        while True:
            with self._lock:
                pending = dict(self._unsettled)
            for tag, fields in pending.items():
                row = self.registry.get_snapshot(tag)
                try:
                    if row is not None and row["status"] == "writing":
                        self.registry.update_snapshot(tag, **fields)
                except Exception:  # noqa: BLE001 - still refused: next round
                    continue
                with self._lock:
                    self._unsettled.pop(tag, None)
            with self._lock:
                if not self._unsettled:
                    self.unsettled_idle.set()
                    return
            time.sleep(SETTLE_RETRY)  # the disk is still full: try again later

    def wait_snapshot(self, tag: str, timeout: float = 60.0) -> dict:
        """Block until snapshot ``tag`` is ``ready`` or ``failed``; returns its registry row."""

        def settled() -> dict | None:
            row = self.overlay(self.registry.get_snapshot(tag))
            if row is None:
                raise NotFound(f"snapshot {tag} not found")
            return row if row["status"] != "writing" else None

        row = self.feed.wait_for(settled, timeout)
        if row is None:
            raise ForkdError(f"snapshot {tag} is still writing after {timeout:g} s")
        return row
