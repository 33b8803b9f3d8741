"""Start-up: take back what outlived the previous server, and end what it left broken.

Templates and sandboxes outlive ``forkd serve`` by design. When a controller starts, it re-attaches
to each one it recorded only if its process lives *and its agent answers* (every agent is pinged at
once, each within ``PROBE_TIMEOUT``), so nothing is listed ``ready`` or ``running`` while dead or
stuck. In order:

1. What the previous server was writing or starting (``writing`` snapshots, ``starting``
   sandboxes) is ended: snapshots become ``failed`` with the reason, starts are dropped.
2. Each engine repairs or ends what only it can see (``Engine.recover``): for the VM engine, a
   source a live branch left frozen is thawed (or killed, saying why) and RAM files no snapshot
   owns are removed; for the process engine, sockets no record names.
3. Every ready snapshot and running sandbox is probed. A VM snapshot whose RAM file tmpfs lost (a
   reboot) answers from the local store and stays ``ready`` (stores.py). A process snapshot whose
   template is gone is ``lost``, saying why: a parked process cannot be written to files, so it
   does not outlive a reboot. A snapshot whose template is silent, or whose files are gone with no
   copy in the store, becomes ``failed`` with the reason (a silent template is left running: its
   sandboxes live in its pid namespace; deleting the snapshot ends it); a sandbox that is gone is
   dropped, and one alive but silent is ended and dropped, its ``killed`` event saying why.
4. Workspaces settle on what is left (``WorkspaceManager.reconcile``).

``run`` returns counts and ``findings``: one line per thing repaired, ended or removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import endings

if TYPE_CHECKING:
    from .controller import Controller

PROBE_TIMEOUT = 5.0  # seconds an agent has to answer its ping when the server starts

INTERRUPTED = "snapshot is not bootable: interrupted by a server restart while it was being written"
LOST = ("snapshot lost: its template process was gone when the server started (the host restarted, or the "
        "process was ended while no server ran); a process-engine snapshot is a parked process, which cannot "
        "be written to files, so it does not outlive a reboot. Create it again, or use engine vm for snapshots "
        "that last")


class Recovery:
    def __init__(self, controller: "Controller"):
        self.ctl = controller
        self.registry = controller.registry
        self.engines = controller.engines
        self.feed = controller.feed

    def run(self) -> dict:
        counts = {"snapshots_attached": 0, "snapshots_failed": 0, "snapshots_lost": 0, "sandboxes_attached": 0,
                  "sandboxes_dropped": 0}
        findings: list[str] = []
        self._end_interrupted(counts)
        snapshots = [r for r in self.registry.list_snapshots() if r["status"] == "ready"]
        sandboxes = [r for r in self.registry.list_sandboxes() if r["status"] == "running" and r["handle"]]
        for name, engine in self.engines.items():
            known = [r["handle"] for r in snapshots + sandboxes if r["engine"] == name and r["handle"]]
            findings += engine.recover(known)
        for name, engine in self.engines.items():
            snaps = [r for r in snapshots if r["engine"] == name]
            boxes = [r for r in sandboxes if r["engine"] == name]
            why = engine.probe([r["handle"] for r in snaps + boxes], PROBE_TIMEOUT) if snaps or boxes else []
            for row, reason in zip(snaps, why[:len(snaps)]):
                if reason is None:
                    counts["snapshots_attached"] += 1
                    continue
                finding, status = self._fail_snapshot(engine, row, reason)
                counts[f"snapshots_{status}"] += 1
                findings.append(finding)
            for row, reason in zip(boxes, why[len(snaps):]):
                if reason is None:
                    counts["sandboxes_attached"] += 1
                    continue
                counts["sandboxes_dropped"] += 1
                findings.append(self._drop_sandbox(engine, row, reason))
        for row in snapshots:  # of an engine this server cannot run: as every listing judges them
            if row["engine"] not in self.engines:
                ready = self.ctl.checked_snapshot(row)["status"] == "ready"
                counts["snapshots_attached" if ready else "snapshots_failed"] += 1
        for row in sandboxes:
            if row["engine"] not in self.engines:
                counts["sandboxes_attached" if self.ctl.sandboxes.alive(row) else "sandboxes_dropped"] += 1
        counts.update(self.ctl.workspaces.reconcile())
        counts["findings"] = findings
        return counts

    def _end_interrupted(self, counts: dict) -> None:
        """Writes and starts the previous server did not finish: their writer is gone."""
        for row in self.registry.list_snapshots():
            if row["status"] != "writing":
                continue
            engine = self.engines.get(row["engine"])
            if engine is not None:
                if row["handle"]:
                    engine.delete_snapshot(row["handle"])
                else:
                    engine.abandon("snap:" + row["tag"])
            self.registry.update_snapshot(row["tag"], status="failed", warning=INTERRUPTED)
            counts["snapshots_failed"] += 1
        for row in self.registry.list_sandboxes():
            if row["status"] == "running" and row["handle"]:
                continue
            engine = self.engines.get(row["engine"])
            if engine is not None:
                engine.abandon(row["id"])
            self.registry.delete_sandboxes([row["id"]])
            counts["sandboxes_dropped"] += 1

    def _fail_snapshot(self, engine, row: dict, reason: str) -> tuple[str, str]:
        """(the finding, ``failed`` or ``lost``) for a snapshot that did not answer."""
        status = "failed"
        if engine.alive(row["handle"]):
            # Alive but silent: left running, since its sandboxes may live inside it.
            warning = (f"snapshot is not bootable: its template did not answer when the server started "
                       f"({reason}); delete the snapshot to end it")
        else:
            ended = endings.how(engine.exit_status(row["handle"]))
            if not hasattr(engine, "store_snapshot"):  # a parked process, no files: gone for good
                status, warning = "lost", LOST + (f" ({ended})" if ended else "")
            else:
                warning = endings.template_ended(engine.exit_status(row["handle"]))
            engine.delete_snapshot(row["handle"])  # releases what the engine held for it
        self.ctl.fail_snapshot(row["tag"], warning, status)
        return f"snapshot {row['tag']}: {warning}", status

    def _drop_sandbox(self, engine, row: dict, reason: str) -> str:
        if engine.alive(row["handle"]):
            ended = {"reason": f"it did not answer when the server started ({reason}); it was ended", "limit_hit": None}
        else:
            ended = self.ctl.sandboxes.death(row)  # a limit it died of while no server watched
        self.ctl.sandboxes.drop(row, ended)
        return f"sandbox {row['id']}: {ended['reason']}"
