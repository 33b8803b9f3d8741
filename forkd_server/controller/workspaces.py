"""Workspaces: named, long-lived sandboxes that suspend into a snapshot and resume from it.

A workspace's state snapshot is ``ws-<name>-state`` (forkd's name). Its row lives in the registry,
so it survives a restart; at start-up a running workspace whose sandbox is gone becomes ``stale``.

Suspend never loses state: the new state is written under a pending tag first, while the sandbox
keeps running; one transaction then makes it ``ws-<name>-state`` (dropping the previous state's row)
and records what is left to retire (the sandbox, the previous state's engine objects) in the
workspace row, and only then are those killed and deleted. A crash at any point leaves the old state
or the new one, and ``reconcile`` finishes or undoes what was pending.

The manager works through its controller (spawn, kill, the branch manager, the registry), as
jupyter_server's session manager works through its kernel manager.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from .checks import check_labels, check_tag, memory_limit
from ..errors import BadRequest, Conflict, EngineFailure, NotFound
from .wire import workspace_info

if TYPE_CHECKING:
    from .controller import Controller

# A workspace's state snapshot is ``ws-<name>-state``; it must itself be a valid tag.
WORKSPACE_NAME_MAX = 64 - len("ws--state")


def state_tag(name: str) -> str:
    return f"ws-{name}-state"


class WorkspaceManager:
    def __init__(self, controller: "Controller"):
        self.ctl = controller
        self.registry = controller.registry
        self.feed = controller.feed
        self._lock = threading.Lock()
        self._busy: dict[str, str] = {}  # workspace name -> the operation holding it

    # --- reading ---------------------------------------------------------------------------------

    def list(self) -> list[dict]:
        return [workspace_info(self._checked(r)) for r in self.registry.list_workspaces()]

    def get(self, name) -> dict:
        return workspace_info(self._checked(self._row(name)))

    def state_holders(self) -> dict[str, str]:
        """{state snapshot tag: workspace name} of every workspace that has a state."""
        return {w["current_state_tag"]: w["name"] for w in self.registry.list_workspaces() if w["current_state_tag"]}

    def _row(self, name) -> dict:
        row = self.registry.get_workspace(name) if isinstance(name, str) else None
        if row is None:
            raise NotFound(f"workspace {name} not found")
        return row

    def _acquire(self, name: str, op: str, *, try_only: bool = False) -> bool:
        """Hold workspace ``name`` for one operation (never blocks): True, or 409 Conflict when
        another operation holds it (False instead with ``try_only``)."""
        with self._lock:
            holder = self._busy.get(name)
            if holder is None:
                self._busy[name] = op
                return True
        if try_only:
            return False
        raise Conflict(f"workspace {name} is busy ({holder} in progress); retry when it is done")

    def _release(self, name: str) -> None:
        with self._lock:
            self._busy.pop(name, None)

    def _sandbox(self, row: dict) -> dict | None:
        """The workspace's live sandbox row, or None when it is gone."""
        sb = self.registry.get_sandbox(row["live_sandbox_id"]) if row["live_sandbox_id"] else None
        if sb is None or sb["status"] != "running" or not (sb["handle"] or sb.get("tier") == "stored") \
                or not self.ctl.sandboxes.alive(sb):
            return None
        return sb

    def _mark_stale(self, row: dict) -> dict:
        if self.registry.mark_workspace_stale(row["name"], row["live_sandbox_id"]):
            self.feed.emit("workspace", "status", name=row["name"], status="stale")
        return dict(row, status="stale", live_sandbox_id=None)

    def _checked(self, row: dict) -> dict:
        """A running workspace whose sandbox died (killed through the sandbox API, say) is stale.
        Skipped while an operation holds the workspace: it is changing the sandbox itself."""
        if row["status"] != "running" or not self._acquire(row["name"], "a status check", try_only=True):
            return row
        try:
            row = self.registry.get_workspace(row["name"]) or row
            if row["status"] == "running" and self._sandbox(row) is None:
                row = self._mark_stale(row)
            return row
        finally:
            self._release(row["name"])

    # --- create, suspend, resume, delete ---------------------------------------------------------

    def create(self, name, snapshot_tag, *, memory_limit_mib=None, labels=None) -> dict:
        """A workspace running one sandbox of ``snapshot_tag``, in forkd's order: unsafe name 400,
        unsafe snapshot_tag 400, the name exists 409, then the spawn's own answers (404 unknown
        snapshot, 409 not bootable, 500). ``labels`` (its owner's, under JupyterHub) go to every
        sandbox it runs and to its state snapshot."""
        check_tag(name, "name")
        if len(name) > WORKSPACE_NAME_MAX:
            raise BadRequest(f"invalid name {name!r}: a workspace name has at most {WORKSPACE_NAME_MAX} "
                             f"characters (its state snapshot ws-<name>-state must be a valid tag)")
        check_tag(snapshot_tag, "snapshot_tag")
        memory_limit_mib = memory_limit(memory_limit_mib)
        self._acquire(name, "create")
        try:
            if self.registry.get_workspace(name) is not None:
                raise Conflict(f"workspace {name} already exists")
            tag = state_tag(name)
            if self.registry.get_snapshot(tag) is not None:
                raise Conflict(f"snapshot {tag} already exists and is not this workspace's (the workspace would "
                               f"keep its state under that tag)",
                               hint="delete the snapshot or choose another name")
            labels = check_labels(labels)
            kid = self.ctl.spawn(snapshot_tag, 1, memory_limit_mib=memory_limit_mib, labels=labels)[0]
            now = time.time()
            try:
                self.registry.insert_workspace({
                    "name": name, "id": "ws-" + kid["id"][:16], "source_snapshot_tag": snapshot_tag,
                    "status": "running", "live_sandbox_id": kid["id"], "memory_limit_mib": memory_limit_mib,
                    "created_at": now, "last_active": now, "labels": labels})
            except BaseException:
                self.ctl.sandboxes.kill_quietly(kid["id"])
                raise
            self.feed.emit("workspace", "created", name=name, status="running", live_sandbox_id=kid["id"])
            return workspace_info(self.registry.get_workspace(name))
        finally:
            self._release(name)

    def suspend(self, name, *, diff: bool = False) -> dict:
        """Snapshot the workspace's sandbox into ``ws-<name>-state`` (mode full, or diff) and kill it,
        in forkd's order: unknown 404, not running 400, busy 409 / 503, sandbox gone 404."""
        row = self._row(name)
        if row["status"] != "running":
            raise BadRequest(f"workspace {name} is not running (status {row['status']})")
        tag = state_tag(name)
        self._acquire(name, "suspend")
        try:
            with self.ctl.branches.reserve(tag, f"a branch to {tag} is already in flight"):
                return self._suspend(name, tag, "diff" if diff else "full")
        finally:
            self._release(name)

    def _suspend(self, name: str, tag: str, mode: str) -> dict:
        row = self._row(name)  # again, now that we hold it
        if row["status"] != "running":
            raise BadRequest(f"workspace {name} is not running (status {row['status']})")
        # The pending tag carries '@', which no user tag may: nobody else can take it, and the
        # engines' objects (named by the tag they were written under) are never reused.
        pending = f"{tag}@{self.registry.next_counter('workspace-state')}"
        release = self.ctl.branches.take_slot(pending)
        try:
            sb = self._sandbox(row)
            if sb is None:
                self._mark_stale(row)
                raise NotFound(f"sandbox {row['live_sandbox_id']} not found: workspace {name}'s sandbox is gone "
                               f"(the workspace is now stale)", hint="resume it to start again from its last state")
            sb = self.ctl.tiers.running_row(sb["id"])  # a frozen or stored sandbox wakes to be branched
            previous = self.registry.get_snapshot(tag)
            if previous is not None and not (row["current_state_tag"] == tag
                                             and (previous["spec"] or {}).get("workspace") == name):
                raise Conflict(f"snapshot {tag} exists and is not workspace {name}'s state",
                               hint="delete it to let the workspace suspend")
        except BaseException:
            release()
            raise
        # [source's lineage..., the sandbox, state]: a resumed sandbox's own earlier generations
        # (previous sandbox, previous state) are left out, so the lineage stays this short.
        ancestors = sb["lineage"][:-1]
        if tag in ancestors:
            ancestors = ancestors[:max(0, ancestors.index(tag) - 1)]
        lineage = ancestors + [sb["id"]]
        spec = {"branched_from": sb["id"], "mode": mode, "workspace": name}
        try:
            self.ctl.branches.branch_into(sb, pending, mode, release, lineage=lineage + [pending],
                                          spec=dict(spec, workspace_pending=True, engine_tag=pending),
                                          labels=row.get("labels"))
            # The new state is safe under `pending`; the sandbox still runs. Swap, then retire.
            self._commit_state(row, self.registry.get_snapshot(pending), previous, lineage + [tag], spec)
        except Exception:
            # The suspend did not happen and the sandbox runs on: its pending state goes (no user
            # can delete an '@' tag). One still being written is settled by a restart's reconcile;
            # a server that dies here (not an Exception) leaves it to reconcile too.
            written = self.registry.get_snapshot(pending)
            if written is not None and written["status"] != "writing":
                self._undo_pending(written)
                self.feed.emit("snapshot", "deleted", tag=pending)
            raise
        self._retire(name)
        self.feed.emit("workspace", "suspended", name=name, status="suspended", current_state_tag=tag)
        return workspace_info(self.registry.get_workspace(name))

    def _commit_state(self, row: dict, pending: dict, previous: dict | None, lineage: list[str],
                      spec: dict) -> None:
        """Make snapshot ``pending`` the workspace's state in one transaction, recording the sandbox
        and the previous state's engine objects as what is left to retire."""
        name, tag = row["name"], state_tag(row["name"])
        retiring = {"sandbox": row["live_sandbox_id"],
                    "snapshot": {"engine": previous["engine"], "handle": previous["handle"]}
                    if previous is not None and previous["handle"] else None}
        # Whatever still names the previous state (a sandbox forked from it, a branch below one)
        # keeps working (snapshots are standalone, a sandbox outlives its snapshot) and names it by
        # the tag it was written under, so the tree never hangs it under the new state.
        retired_as = None if previous is None else (previous["spec"] or {}).get("engine_tag") or f"{tag}@retired"
        self.registry.commit_workspace_state(
            name, pending["tag"], tag, lineage=lineage, retired_as=retired_as,
            spec=dict(spec, engine_tag=pending["tag"]),
            workspace={"status": "suspended", "live_sandbox_id": None, "current_state_tag": tag,
                       "last_active": time.time(), "retiring": retiring,
                       "last_branch_memory_path": (pending["handle"] or {}).get("memory")})
        self.feed.emit("snapshot", "deleted", tag=pending["tag"])
        if previous is not None:
            self.feed.emit("snapshot", "deleted", tag=tag)
        self.feed.emit("snapshot", "created", tag=tag, status="ready", branched_from=pending["branched_from"])
        self.ctl.stores.store_later(tag)  # under its final tag: the pending one is gone from the registry

    def _retire(self, name: str) -> None:
        """Kill and delete what a suspend left to retire; kept for reconcile if anything fails."""
        row = self.registry.get_workspace(name)
        duty = (row or {}).get("retiring") or {}
        done = True
        if duty.get("sandbox"):
            done = self.ctl.sandboxes.kill_quietly(duty["sandbox"])
        snap = duty.get("snapshot")
        if snap:
            engine = self.ctl.engines.get(snap["engine"])
            try:
                if engine is not None:
                    engine.delete_snapshot(snap["handle"])
            except Exception:  # noqa: BLE001 - retried by reconcile
                done = False
        if duty and done:
            self.registry.update_workspace(name, retiring=None)

    def resume(self, name) -> dict:
        """Fork the workspace's sandbox again from its state (or its source snapshot if it was never
        suspended), with its memory limit: unknown 404, already running 400, busy 409, then the
        spawn's answers (404 when the snapshot is gone, 409 not bootable, 500)."""
        row = self._row(name)
        if row["status"] == "running":
            raise BadRequest(f"workspace {name} is already running")
        self._acquire(name, "resume")
        try:
            row = self._row(name)
            if row["status"] == "running":
                raise BadRequest(f"workspace {name} is already running")
            kid = self.ctl.spawn(row["current_state_tag"] or row["source_snapshot_tag"], 1,
                                 memory_limit_mib=row["memory_limit_mib"], labels=row.get("labels"))[0]
            try:
                self.registry.update_workspace(name, status="running", live_sandbox_id=kid["id"],
                                               last_active=time.time())
            except BaseException:
                self.ctl.sandboxes.kill_quietly(kid["id"])
                raise
            self.feed.emit("workspace", "resumed", name=name, status="running", live_sandbox_id=kid["id"])
            return workspace_info(self.registry.get_workspace(name))
        finally:
            self._release(name)

    def delete(self, name) -> None:
        """Kill the live sandbox, delete the state snapshot, forget the workspace (404 unknown, 409 busy)."""
        self._row(name)
        self._acquire(name, "delete")
        try:
            row = self._row(name)
            if row["live_sandbox_id"] and not self.ctl.sandboxes.kill_quietly(row["live_sandbox_id"]):
                raise EngineFailure(f"workspace {name}: could not kill sandbox {row['live_sandbox_id']}")
            self._retire(name)
            state = self.registry.get_snapshot(row["current_state_tag"]) if row["current_state_tag"] else None
            if state is not None and (state["spec"] or {}).get("workspace") == name:
                engine = self.ctl.engines.get(state["engine"])
                if engine is not None and state["handle"]:
                    engine.delete_snapshot(state["handle"])
                self.registry.delete_snapshot_renaming_references(
                    state["tag"], (state["spec"] or {}).get("engine_tag") or f"{state['tag']}@retired")
                self.feed.emit("snapshot", "deleted", tag=state["tag"])
            self.registry.delete_workspace(name)
            self.feed.emit("workspace", "deleted", name=name)
        finally:
            self._release(name)

    def _undo_pending(self, snap: dict) -> None:
        """A suspend's pending state (``ws-<name>-state@n``) that never became the workspace's: its
        engine object and its record go."""
        engine = self.ctl.engines.get(snap["engine"])
        if engine is not None:
            if snap["handle"]:
                engine.delete_snapshot(snap["handle"])
            else:
                engine.abandon("snap:" + snap["tag"])
        self.registry.delete_snapshot(snap["tag"])

    # --- start-up --------------------------------------------------------------------------------

    def reconcile(self) -> dict:
        """After a restart: finish retirements, settle suspends that were cut short, mark running
        workspaces whose sandbox is gone ``stale``."""
        counts = {"workspaces_stale": 0, "workspace_suspends_finished": 0, "workspace_suspends_undone": 0}
        for ws in self.registry.list_workspaces():
            if ws["retiring"]:
                self._retire(ws["name"])
        for snap in self.registry.list_snapshots():
            spec = snap["spec"] or {}
            if not spec.get("workspace_pending"):
                continue
            ws = self.registry.get_workspace(spec.get("workspace"))
            if (snap["status"] == "ready" and ws is not None and ws["status"] in ("running", "stale")
                    and ws["live_sandbox_id"] in (spec.get("branched_from"), None)
                    and self._sandbox(ws) is None):
                # The state was written and the sandbox is gone since: the suspend finishes.
                tag = state_tag(ws["name"])
                previous = self.registry.get_snapshot(tag)
                lineage = snap["lineage"][:-1] + [tag]
                self._commit_state(dict(ws, live_sandbox_id=spec.get("branched_from")), snap, previous, lineage,
                                   {k: v for k, v in spec.items() if k not in ("workspace_pending", "engine_tag")})
                self._retire(ws["name"])
                counts["workspace_suspends_finished"] += 1
                continue
            self._undo_pending(snap)  # the sandbox still runs (or the write failed)
            counts["workspace_suspends_undone"] += 1
        for ws in self.registry.list_workspaces():
            if ws["status"] == "running" and self._sandbox(ws) is None:
                self._mark_stale(ws)
                counts["workspaces_stale"] += 1
        return counts
