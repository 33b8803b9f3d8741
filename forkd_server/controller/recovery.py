"""Start-up: take back what outlived the previous server, and end what it left broken, one object
at a time, so that nothing one sandbox, VM or snapshot left behind can stop the server starting.

Templates and sandboxes outlive ``forkd serve`` by design. When a controller starts it reads the
registry (milliseconds) and from then on every object it recorded is *settling*: a call about it
answers 503 "recovering" until it is settled, and a sandbox is not listed. Under the server the
settling runs on threads from the moment the port listens (``Controller(recover_in_background=True)``
and ``Controller.listening``); each object is settled on its own, all at once (``SETTLE_WORKERS``),
and whatever goes wrong with one (an engine error, a VM that will not thaw) fails that object
alone, with the reason:

- what the previous server was writing (``writing`` snapshots) becomes ``failed``, its leftovers
  ended; a start it did not finish (``starting`` sandboxes) is ended and dropped;
- a sandbox whose end was under way (its row's ``ending``: a kill, or a drop, the server died in)
  is ended now, and its row goes once its process has;
- every ready snapshot and running sandbox is first repaired where only its engine can see what
  is wrong (``Engine.repair``: a VM a live branch left frozen is thawed), then pinged (within
  ``PROBE_TIMEOUT``): one that answers is taken back as it was. A VM snapshot whose RAM file tmpfs
  lost (a reboot) answers from the local store and stays ``ready`` (stores.py). A process snapshot
  whose template is gone is ``lost``, saying why: a parked process cannot be written to files, so
  it does not outlive a reboot. A snapshot whose template is silent, or whose files are gone with
  no copy in the store, becomes ``failed`` with the reason. A sandbox that is gone is
  dropped, one alive but silent is ended and dropped, its ``killed`` event saying why;
- a frozen sandbox (tiers.py) is thawed for its ping and frozen again; a stored one has no process
  to ping: it stays stored while its stored state is whole (a VM a store cut short left running is
  ended), and is dropped, saying why, when that state is gone;
- an object whose settling raised is marked so: a snapshot ``failed``, a sandbox ended and
  dropped ("lost"), the reason in its record;
- nothing of a process snapshot that failed here runs on: its template is ended as a delete would end it
  (``_end_template``), which leaves the sandboxes spawned from it running (their pid namespace is
  held by the template's init, not by its agent);
- workspaces then settle on what is left (``WorkspaceManager.reconcile``; workspace calls answer
  503 until then); then, while calls go on, the stores resume what the previous server left
  (``StoreManager.resume``: snapshots not stored yet, pushes cut short) and each engine ends and
  removes what no record names and that predates it (``Engine.recover``: agents behind unknown
  sockets, RAM files, VM directories, QEMUs nobody records).

``result()`` gives counts and ``findings``: one line per thing repaired, ended or removed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Callable

from forkd_engine import EngineError

from . import endings
from ..errors import Recovering

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger("forkd.recovery")

PROBE_TIMEOUT = 5.0    # seconds an agent has to answer its ping when the server starts
SETTLE_WORKERS = 128   # objects settled at once: most of a settle is waiting (a silent agent, a kill)

INTERRUPTED = "snapshot is not bootable: interrupted by a server restart while it was being written"
LOST = ("snapshot lost: its template process was gone when the server started (the host restarted, or the "
        "process was ended while no server ran); a process-engine snapshot is a parked process, which cannot "
        "be written to files, so it does not outlive a reboot. Create it again, or use engine vm for snapshots "
        "that last")
RETRY = ("retry in a moment: the server restarted and settles what it recorded "
         "(GET /healthz says how many are left)")


class Recovery:
    def __init__(self, controller: "Controller", probe_timeout: float | None = None):
        self.ctl = controller
        self.probe_timeout = PROBE_TIMEOUT if probe_timeout is None else probe_timeout
        self.registry = controller.registry
        self.engines = controller.engines
        self.sandboxes: set[str] = set()   # ids not settled yet
        self.snapshots: set[str] = set()   # tags not settled yet
        self.counts = {"snapshots_attached": 0, "snapshots_failed": 0, "snapshots_lost": 0, "sandboxes_attached": 0,
                       "sandboxes_dropped": 0}
        self.findings: list[str] = []
        self._lock = threading.Lock()
        self._settled = threading.Event()   # every recorded object (and workspace) settled
        self._finished = threading.Event()  # and the engines' sweeps done
        self.started = time.monotonic()
        self.settled_s: float | None = None  # seconds from start to the last object settled
        self.on_done: Callable[[dict], None] | None = None
        self._waiting: list | None = None  # the jobs of a background run, until go()

    # --- what callers ask --------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Objects not settled yet (0 once recovery is over)."""
        if self._settled.is_set():
            return 0
        return max(1, len(self.sandboxes) + len(self.snapshots))  # 1: the workspaces, settled last

    def unsettled(self) -> set[str]:
        """Ids and tags not settled yet (a copy: the settling threads change the sets)."""
        with self._lock:
            return self.sandboxes | self.snapshots

    def check_sandbox(self, sandbox_id: str) -> None:
        if sandbox_id in self.sandboxes:
            raise Recovering(f"sandbox {sandbox_id} is recovering: the server restarted and has not settled it yet",
                             hint=RETRY, recovering=True)

    def check_snapshot(self, tag: str) -> None:
        if tag in self.snapshots:
            raise Recovering(f"snapshot {tag} is recovering: the server restarted and has not settled it yet",
                             hint=RETRY, recovering=True)

    def check_workspaces(self) -> None:
        if not self._settled.is_set():
            raise Recovering("workspaces are recovering: the server restarted and settles them once their "
                             "sandboxes and snapshots are", hint=RETRY, recovering=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until everything is settled and swept (starting it, if the server has not); True once
        it is."""
        self.go()
        return self._finished.wait(timeout)

    def result(self) -> dict:
        with self._lock:
            return {**self.counts, "findings": list(self.findings)}

    # --- the run -------------------------------------------------------------------------------------

    def start(self, background: bool) -> None:
        """Read what to settle (fast, here), then settle it and sweep: here, or (``background``) on a
        thread of its own from ``go()`` on, which the server calls once its port listens: on a
        busy host the settling's threads would slow the rest of the start (anything that waits
        for the recovery calls ``go()`` too). With nothing recorded, the settling (workspaces
        alone) is done here either way."""
        jobs = self._plan()
        if not background:
            self._settle_all(jobs)
            self._sweep()
            return
        if not jobs:
            self._settle_all(jobs)
        self._waiting = jobs

    def go(self) -> None:
        """Start the background settling and sweep (the first call; later ones do nothing)."""
        with self._lock:
            jobs, self._waiting = self._waiting, None
        if jobs is not None:
            threading.Thread(target=self._background, args=(jobs,), name="forkd-recovery", daemon=True).start()

    def _background(self, jobs: list) -> None:
        if not self._settled.is_set():
            self._settle_all(jobs)
        self._sweep()

    def _plan(self) -> list[tuple[str, str, Callable[[dict], None], dict]]:
        """The jobs, one per object: (kind, key, settle function, row); their keys become pending."""
        jobs = []
        for row in self.registry.list_snapshots():
            if row["engine"] not in self.engines:  # of an engine this server cannot run: as every listing judges them
                ready = self.ctl.checked_snapshot(row)["status"] == "ready"
                self.counts["snapshots_attached" if ready else "snapshots_failed"] += 1
            elif row["status"] == "writing":
                jobs.append(("snapshot", row["tag"], self._end_write, row))
            elif row["status"] == "ready":
                jobs.append(("snapshot", row["tag"], self._probe_snapshot, row))
        for row in self.registry.list_sandboxes():
            if row["engine"] not in self.engines:
                self.counts["sandboxes_attached" if self.ctl.sandboxes.alive(row) else "sandboxes_dropped"] += 1
            elif row.get("ending"):
                jobs.append(("sandbox", row["id"], self._finish_end, row))
            elif row.get("tier") == "stored":
                jobs.append(("sandbox", row["id"], self._settle_stored, row))
            elif row["status"] == "running" and row["handle"]:
                jobs.append(("sandbox", row["id"], self._probe_sandbox, row))
            else:
                jobs.append(("sandbox", row["id"], self._end_start, row))
        self.snapshots = {key for kind, key, _fn, _row in jobs if kind == "snapshot"}
        self.sandboxes = {key for kind, key, _fn, _row in jobs if kind == "sandbox"}
        return jobs

    def _settle_all(self, jobs: list) -> None:
        """Every recorded object, all at once, then the workspaces on what is left."""
        try:
            if jobs:
                with ThreadPoolExecutor(max_workers=min(SETTLE_WORKERS, len(jobs)),
                                        thread_name_prefix="forkd-settle") as pool:
                    wait([pool.submit(self._settle, *job) for job in jobs])
            try:
                self.counts.update(self.ctl.workspaces.reconcile())
            except Exception as exc:  # noqa: BLE001 - the server comes up; the workspaces say stale
                log.exception("forkd: workspaces could not be settled")
                self._found(f"workspaces: could not be settled after the restart ({type(exc).__name__}: {exc})")
        finally:
            self.sandboxes, self.snapshots = set(), set()
            self.settled_s = time.monotonic() - self.started
            self._settled.set()

    def _sweep(self) -> None:
        """Each engine ends and removes what no record names (all engines at once), then says so.
        Calls go on meanwhile: an engine sweeps only what predates it."""
        try:
            try:
                self._found(*self.ctl.stores.resume())
            except Exception as exc:  # noqa: BLE001 - what it could not resume waits for the next start
                log.exception("forkd: the stores could not resume")
                self._found(f"stores: could not resume what the previous server left ({type(exc).__name__}: {exc})")
            known = [r["handle"] for r in self.registry.list_snapshots() + self.registry.list_sandboxes()
                     if r["handle"]] + self.ctl.tiers.stored_handles()
            engines = list(self.engines.items())
            with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
                for found in pool.map(lambda named: self._guarded(named, known), engines):
                    self._found(*found)
        finally:
            self._finished.set()
            if self.on_done is not None:
                self.on_done(self.result())

    def _guarded(self, named_engine: tuple, known: list) -> list[str]:
        name, engine = named_engine
        try:
            return engine.recover(known)
        except Exception as exc:  # noqa: BLE001 - what it could not remove stays for the next start
            log.exception("forkd: %s engine: recover failed", name)
            return [f"{name} engine: could not look for leftovers no record names ({type(exc).__name__}: {exc})"]

    def _found(self, *lines: str) -> None:
        with self._lock:
            self.findings += lines

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _settle(self, kind: str, key: str, fn: Callable[[dict], None], row: dict) -> None:
        """Settle one object; whatever it raises fails that object alone, saying why."""
        try:
            fn(row)
        except Exception as exc:  # noqa: BLE001 - one object's failure is that object's
            why = f"{type(exc).__name__}: {exc}"
            log.warning("forkd: %s %s could not be recovered: %s", kind, key, why)
            try:
                if kind == "snapshot":
                    self._lose_snapshot(row, why)
                else:
                    self._lose_sandbox(row, why)
            except Exception as again:  # noqa: BLE001 - recorded for the next start
                log.exception("forkd: %s %s could not be marked lost", kind, key)
                self._found(f"{kind} {key}: could not be recovered ({why}) nor marked so ({again})")
        finally:
            with self._lock:
                (self.snapshots if kind == "snapshot" else self.sandboxes).discard(key)

    # --- one object each -------------------------------------------------------------------------

    def _end_write(self, row: dict) -> None:
        """A snapshot the previous server was writing: its writer is gone, so it is failed."""
        engine = self.engines[row["engine"]]
        try:
            if row["handle"]:
                engine.delete_snapshot(row["handle"])
            else:
                engine.abandon("snap:" + row["tag"])
        finally:
            self.registry.update_snapshot(row["tag"], status="failed", warning=INTERRUPTED)
            self._count("snapshots_failed")

    def _end_start(self, row: dict) -> None:
        """A spawn the previous server did not finish recording: no handle, so it is ended by name."""
        self.engines[row["engine"]].abandon(row["id"])
        self.registry.delete_sandboxes([row["id"]])
        self._count("sandboxes_dropped")
        self._found(f"sandbox {row['id']}: ended its start, cut short when the server stopped")

    def _finish_end(self, row: dict) -> None:
        """A kill (or drop) the previous server started and did not see through."""
        self.ctl.sandboxes.end(row, row["ending"])
        self._count("sandboxes_dropped")
        self._found(f"sandbox {row['id']}: finished its end, under way when the server stopped "
                    f"({row['ending']['reason']})")

    def _repair(self, engine, row: dict, what: str) -> None:
        for line in engine.repair(row["handle"]):
            self._found(f"{engine.name} engine: {what}: {line}")

    def _probe_snapshot(self, row: dict) -> None:
        engine = self.engines[row["engine"]]
        self._repair(engine, row, f"snapshot {row['tag']}")
        reason = engine.probe([row["handle"]], self.probe_timeout)[0]
        if reason is None:
            self._count("snapshots_attached")
            self._keep_warnings(engine, row)
            return
        finding, status = self._fail_snapshot(engine, row, reason)
        self._count(f"snapshots_{status}")
        self._found(finding)

    def _keep_warnings(self, engine, row: dict) -> None:
        """What the engine sees in a snapshot's handle that its users should know, kept with it."""
        kept = list(row.get("warnings") or [])
        new = [line for line in engine.snapshot_warnings(row["handle"]) if line not in kept]
        if new:
            self.registry.update_snapshot(row["tag"], warnings=kept + new)
            self._found(*(f"{engine.name} engine: snapshot {row['tag']}: {line}" for line in new))

    def _probe_sandbox(self, row: dict) -> None:
        engine = self.engines[row["engine"]]
        frozen = row.get("tier") == "frozen"
        if frozen:  # a frozen agent answers no ping: thawed for the probe, frozen again after
            try:
                engine.thaw(row["handle"])
            except EngineError as exc:
                self._found(f"sandbox {row['id']}: could not thaw it for its probe ({exc})")
        self._repair(engine, row, f"sandbox {row['id']}")
        reason = engine.probe([row["handle"]], self.probe_timeout)[0]
        if reason is None:
            if frozen:
                try:
                    engine.freeze(row["handle"])
                except EngineError as exc:  # it answers and runs: kept running, said so
                    self.registry.update_sandbox(row["id"], tier=None)
                    self._found(f"sandbox {row['id']}: could not freeze it again after its probe ({exc}); it runs")
            self._count("sandboxes_attached")
            return
        self._count("sandboxes_dropped")
        self._found(self._drop_sandbox(engine, row, reason))

    def _settle_stored(self, row: dict) -> None:
        """A stored sandbox (tiers.py): kept, stored and wakeable, while its stored state is whole."""
        reason = self.ctl.tiers.settle_stored(row)
        if reason is None:
            self._count("sandboxes_attached")
            return
        self._count("sandboxes_dropped")
        ended = {"reason": f"{reason} when the server started; it was dropped", "limit_hit": None}
        self.ctl.sandboxes.drop(self.registry.get_sandbox(row["id"]) or row, ended)
        self._found(f"sandbox {row['id']}: {ended['reason']}")

    def _fail_snapshot(self, engine, row: dict, reason: str) -> tuple[str, str]:
        """(the finding, ``failed`` or ``lost``) for a snapshot that did not answer."""
        status = "failed"
        if engine.alive(row["handle"]):
            warning = (f"snapshot is not bootable: its template did not answer when the server started "
                       f"({reason}); {self._end_template(engine, row)}")
        else:
            ended = endings.how(engine.exit_status(row["handle"]))
            if not hasattr(engine, "store_snapshot"):  # a parked process, no files: gone for good
                status, warning = "lost", LOST + (f" ({ended})" if ended else "")
            else:
                warning = endings.template_ended(engine.exit_status(row["handle"]))
            engine.delete_snapshot(row["handle"])  # releases what the engine held for it
        self.ctl.fail_snapshot(row["tag"], warning, status)
        return f"snapshot {row['tag']}: {warning}", status

    @staticmethod
    def _end_template(engine, row: dict) -> str:
        """End the template process of a snapshot that failed here, as deleting it would, and say
        so. Its sandboxes do not depend on it: this ends the template's agent, while its forkd-init
        holds the pid namespace the sandboxes spawned from it are nested in and exits after the last
        of them (a template from before forkd-init is asked to retire, and never forced while forks
        of it live). A snapshot made of files (the VM engine) runs nothing here, and its files stay
        until the user deletes it: they are the saved state, and what failed may be mended."""
        if not getattr(engine, "snapshots_are_processes", False):
            return "delete the snapshot to remove its files"
        try:
            engine.delete_snapshot(row["handle"])
        except Exception as exc:  # noqa: BLE001 - the snapshot is failed all the same; a delete tries again
            log.warning("forkd: the template of snapshot %s would not end: %s", row["tag"], exc)
            return f"its template would not end ({type(exc).__name__}: {exc}): delete the snapshot to end it"
        return "its template was ended (sandboxes spawned from it run on); delete the snapshot to remove it"

    def _drop_sandbox(self, engine, row: dict, reason: str) -> str:
        if engine.alive(row["handle"]):
            ended = {"reason": f"it did not answer when the server started ({reason}); it was ended", "limit_hit": None}
        else:
            ended = self.ctl.sandboxes.death(row)  # a limit it died of while no server watched
        self.ctl.sandboxes.drop(row, ended)
        return f"sandbox {row['id']}: {ended['reason']}"

    def _lose_snapshot(self, row: dict, why: str) -> None:
        warning = f"snapshot is not bootable: it could not be recovered when the server started ({why})"
        engine = self.engines[row["engine"]]
        if row["handle"]:
            warning += f"; {self._end_template(engine, row)}"
        self.ctl.fail_snapshot(row["tag"], warning)
        self._count("snapshots_failed")
        self._found(f"snapshot {row['tag']}: {warning}")

    def _lose_sandbox(self, row: dict, why: str) -> None:
        """End a sandbox that could not be settled: nothing of it may run unrecorded."""
        ended = {"reason": f"it could not be recovered when the server started ({why}); it was ended",
                 "limit_hit": None}
        try:
            self.ctl.sandboxes.end(row, ended)
        except EngineError as exc:
            ended["reason"] += f", but its process would not exit ({exc}): the next start ends it"
        self._count("sandboxes_dropped")
        self._found(f"sandbox {row['id']}: {ended['reason']}")
