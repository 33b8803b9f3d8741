"""The controller: forkd's v1 policy, independent of HTTP.

It validates requests in forkd's documented check order, owns tags and lineage, records every
change in the registry before and after the engine acts, and re-attaches to live templates and
sandboxes when it starts. Handlers and front ends call it; it calls an engine; neither knows of the
other. It is the facade over one manager per concern, as jupyter_server keeps one per service:
``sandboxes`` (spawn, list, kill, the agent calls: sandboxes.py), ``branches`` (branch concurrency
slots and a written snapshot's writing -> ready life: branching.py), ``trees`` (fork trees: fork a
sandbox into N children, promote the winner: forktrees.py), ``workspaces``
(workspaces.py), ``creation`` (snapshots from setup code within limits, and cancelling them:
creation.py) and the start-up recovery (recovery.py). Snapshots and the branch and compact check
orders are its own; the wire shapes of its answers are in wire.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable

from forkd_engine import EngineError

from .. import startup
from . import endings
from .branching import BranchManager
from .capacity import capacity
from .changes import ChangeFeed
from .creation import CreationManager
from .checks import BRANCH_MODES, check_labels, check_tag
from ..errors import BadRequest, Conflict, EngineFailure, NotFound
from .forktrees import ForkTreeManager
from .recovery import Recovery
from .registry import Registry
from .sandboxes import SandboxManager
from .stores import StoreManager
from .tiers import TierManager
from .wire import has_labels, sandbox_info, snapshot_info, tree_nodes, workspace_info
from .workspaces import WorkspaceManager, state_tag

__all__ = ["Controller", "check_tag", "default_data_dir"]

log = logging.getLogger("forkd.controller")


def default_data_dir() -> str:
    """``$FORKD_DATA_DIR``, else ``$XDG_DATA_HOME/forkd``, else ``~/.local/share/forkd``."""
    return os.environ.get("FORKD_DATA_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "forkd")


class Controller:
    def __init__(self, data_dir: str, engines: dict | None = None, *, branch_concurrency: int = 4,
                 default_engine: str = "auto", store: str | None = None, store_options: dict | None = None,
                 recover_in_background: bool = False, probe_timeout: float | None = None,
                 max_sandboxes: int | None = None):
        """``recover_in_background``: return once the registry is read, and settle what outlived the
        previous server on threads meanwhile (calls about an object not settled yet answer 503);
        else return once all of it is settled (recovery.py). ``probe_timeout``: seconds each
        recorded agent has to answer its ping then (default ``recovery.PROBE_TIMEOUT``).
        The server calls ``listening()`` once its port listens, which starts that settling.
        ``max_sandboxes``: the most sandboxes this host holds at once; a spawn past it is refused
        whole (503); None for no cap."""
        if branch_concurrency < 1:
            raise ValueError("branch_concurrency must be at least 1")
        if max_sandboxes is not None and max_sandboxes < 0:
            raise ValueError("max_sandboxes must be at least 0")
        self.max_sandboxes = max_sandboxes
        self.data_dir = os.path.realpath(data_dir)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.registry = Registry(os.path.join(self.data_dir, "registry.sqlite3"))
        startup.mark("registry opened")
        self.unavailable: dict[str, str] = {}  # engine name -> why this host cannot run it
        self.engines = dict(engines) if engines is not None else self._default_engines()
        self.default_engine = default_engine
        self.feed = ChangeFeed()
        self.branches = BranchManager(self.registry, self.engines, self.feed, branch_concurrency)
        self.sandboxes = SandboxManager(self)
        self.tiers = TierManager(self)  # running -> frozen -> stored, and the wake on the next call
        self.workspaces = WorkspaceManager(self)
        self.creation = CreationManager(self)
        self.trees = ForkTreeManager(self)
        self.stores = StoreManager(self, store, store_options)  # local durability, push and pull
        self.branches.on_ready = self.stores.store_later
        self.recovery = Recovery(self, probe_timeout)  # ends with self.stores.resume()
        self.recovery.start(background=recover_in_background)
        startup.mark("recovery planned (registry read)")
        if not recover_in_background:
            self._warm_up_engines()

    def listening(self) -> None:
        """The server's port listens: start what waited for it, on threads: the settling of what the
        previous server left (recovery.py) and each engine's warm-up (imports, host probes)."""
        self.recovery.go()
        self._warm_up_engines()

    def _warm_up_engines(self) -> None:
        def warm(name: str, engine) -> None:
            try:
                engine.warm_up()
            except Exception:  # noqa: BLE001 - an optimisation: what it did not load loads on first use
                log.exception("forkd: %s engine: warm-up failed", name)

        for name, engine in self.engines.items():
            threading.Thread(target=warm, args=(name, engine), name=f"forkd-{name}-warm-up", daemon=True).start()

    def reconcile(self) -> dict:
        """Settle again, here, everything the registry records, as a start-up does (recovery.py);
        returns counts and ``findings``."""
        self.recovery.wait()
        self.recovery = Recovery(self, self.recovery.probe_timeout)
        self.recovery.start(background=False)
        return self.recovery.result()

    @property
    def recovered(self) -> dict:
        """What the start-up found (counts and ``findings``), once it has settled everything."""
        self.recovery.wait()
        return self.recovery.result()

    def capacity(self) -> dict:
        """What this host can still take, as ``/healthz`` reports it (capacity.py): cheap reads only."""
        return capacity(self)

    @property
    def branch_cap(self) -> int:
        return self.branches.cap

    def _default_engines(self) -> dict:
        from forkd_engine import EngineUnavailable
        from forkd_engine.process import ProcessEngine

        engines = {}
        try:
            engines["process"] = ProcessEngine(os.path.join(self.data_dir, "process"))
        except EngineUnavailable as exc:
            self.unavailable["process"] = str(exc)
        startup.mark("process engine")
        from forkd_engine.vm import VMEngine, qemu_binary
        if qemu_binary() is None:
            self.unavailable["vm"] = "qemu-system-x86_64 is not installed (scripts/setup.sh installs it)"
        else:
            try:
                # preferred (picked by engine "auto") only where KVM is usable; TCG is correct but slow.
                engines["vm"] = VMEngine(os.path.join(self.data_dir, "vm"))
            except EngineUnavailable as exc:
                self.unavailable["vm"] = str(exc)
        startup.mark("vm engine")
        return engines

    def close(self) -> None:
        self.recovery.wait()  # its threads use the engines and the registry
        self.stores.close()
        for engine in self.engines.values():
            engine.close()
        self.registry.close()

    # --- events ----------------------------------------------------------------------------------

    def subscribe(self, listener: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``listener(event)`` on every change; returns a function that unsubscribes."""
        return self.feed.subscribe(listener)

    def publish(self, kind: str, action: str, **data) -> None:
        """Send a change event of a manager beside the controller (kernels) to every listener."""
        self.feed.emit(kind, action, **data)

    # --- helpers ---------------------------------------------------------------------------------

    def _engine(self, name: str):
        if name == "auto":
            name = self.default_engine if self.default_engine != "auto" else (
                "vm" if "vm" in self.engines and getattr(self.engines["vm"], "preferred", False) else "process")
        engine = self.engines.get(name)
        if engine is None:
            why = self.unavailable.get(name) or f"available: {', '.join(sorted(self.engines)) or 'none'}"
            raise BadRequest(f"engine {name!r} is not available on this server ({why})",
                             hint="`forkd doctor` checks what this host has for each engine")
        return name, engine

    def checked_snapshot(self, row: dict) -> dict:
        """A ready snapshot whose template died outside our control becomes failed, with a reason."""
        row = self.branches.overlay(row)  # a write whose final record was refused reads as failed
        if row["status"] != "ready" or row["tag"] in self.recovery.snapshots:  # settled by recovery.py
            return row
        engine = self.engines.get(row["engine"])
        if engine is not None and engine.alive(row["handle"]):
            return row
        warning = endings.TEMPLATE_ENDED
        if engine is not None:
            warning = endings.template_ended(engine.exit_status(row["handle"]))  # read before the delete
            engine.delete_snapshot(row["handle"])
        self.fail_snapshot(row["tag"], warning)
        return dict(row, status="failed", warning=warning)

    def fail_snapshot(self, tag: str, warning: str, status: str = "failed") -> None:
        """Snapshot ``tag`` is ``failed`` (or ``lost``: gone with the host's restart), for the reason
        ``warning``: recorded, and said on the feed."""
        self.registry.update_snapshot(tag, status=status, warning=warning)
        self.feed.emit("snapshot", "status", tag=tag, status=status, warning=warning)

    snapshot_info = staticmethod(snapshot_info)
    sandbox_info = staticmethod(sandbox_info)

    # --- snapshots -------------------------------------------------------------------------------

    def create_snapshot(self, tag, *, engine: str = "auto", setup: str | None = None,
                        setup_commands: list | None = None, mem_size_mib: int | None = None,
                        host_network: bool = False, disk_mib: int | None = None,
                        packages: list[str] | None = None, lossy: bool = False, shell: str = "plain",
                        labels: dict | None = None, setup_timeout_secs: float | None = None,
                        memory_limit_mib: int | None = None) -> dict:
        """A snapshot from setup code, run within a sandbox's limits (creation.py)."""
        return self.creation.create(tag, engine=engine, setup=setup, setup_commands=setup_commands,
                                    mem_size_mib=mem_size_mib, host_network=host_network, disk_mib=disk_mib,
                                    packages=packages, lossy=lossy, shell=shell, labels=labels,
                                    setup_timeout_secs=setup_timeout_secs, memory_limit_mib=memory_limit_mib)

    def list_snapshots(self, labels: dict[str, str] | None = None) -> list[dict]:
        """Every snapshot (those still writing last); with ``labels``, those carrying all of them."""
        rows = [self.checked_snapshot(r) for r in self.registry.list_snapshots() if has_labels(r.get("labels"), labels or {})]
        done = [self.snapshot_info(r) for r in rows if r["status"] != "writing"]
        return done + [self.snapshot_info(r) for r in rows if r["status"] == "writing"]

    def get_snapshot(self, tag) -> dict:
        check_tag(tag)
        row = self.registry.get_snapshot(tag)
        if row is None:
            raise NotFound(f"snapshot {tag} not found")
        return self.snapshot_info(self.checked_snapshot(row))

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
            with contextlib.suppress(EngineError, OSError):  # its template ended meanwhile: no figures
                info["memory"] = engine.memory(row["handle"])
        return info

    def delete_snapshot(self, tag, *, cascade: bool = False, force: bool = False) -> None:
        check_tag(tag)
        if cascade and force:
            raise BadRequest("cascade and force are mutually exclusive")
        self.recovery.check_snapshot(tag)
        if tag in self.branches.in_flight:
            if self.creation.cancel(tag):  # a snapshot being created: its setup is stopped, nothing stays
                return
            raise Conflict(f"snapshot {tag} is being written; wait until it is ready or failed")
        row = self.registry.get_snapshot(tag)
        if row is None:
            raise NotFound(f"snapshot {tag} not found")
        # Snapshots never depend on each other here (a branch is a complete snapshot), so force has
        # nothing to orphan; cascade also deletes every snapshot branched further down the lineage.
        victims = [row]
        if cascade:
            victims += [r for r in self.registry.list_snapshots() if r["tag"] != tag and tag in r["lineage"]]
        states = self.workspaces.state_holders()
        for victim in victims:
            if victim["tag"] in states:
                name = states[victim["tag"]]
                raise Conflict(f"snapshot {victim['tag']} holds the state of workspace {name}"
                               + (f" (cascade from {tag} would delete it)" if victim["tag"] != tag else ""),
                               hint="delete the workspace instead",
                               details={"rest": f"DELETE /v1/workspaces/{name}", "cli": f"forkd workspace delete {name}"})
        for victim in victims[1:]:
            self.recovery.check_snapshot(victim["tag"])
        for victim in reversed(victims):
            engine = self.engines.get(victim["engine"])
            if victim["handle"] and engine is not None:
                engine.delete_snapshot(victim["handle"])
            self.registry.delete_snapshot(victim["tag"])
            self.feed.emit("snapshot", "deleted", tag=victim["tag"])

    # --- sandboxes (sandboxes.py) ----------------------------------------------------------------

    def spawn(self, snapshot_tag, n=1, *, memory_limit_mib=None, labels=None, **_forkd_options) -> list[dict]:
        """Fork ``n`` sandboxes from a snapshot. forkd's VM-only options are accepted and ignored."""
        return self.sandboxes.spawn(snapshot_tag, n, memory_limit_mib=memory_limit_mib, labels=labels)

    def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[dict]:
        """Every running sandbox; with ``labels``, those carrying all of them."""
        return [info for info in self.sandboxes.list() if has_labels(info["labels"], labels or {})]

    def sandbox_listing(self) -> tuple[int, list[dict], list[bool]]:
        return self.sandboxes.listing()

    def get_sandbox(self, sandbox_id) -> dict:
        return self.sandboxes.get(sandbox_id)

    def kill_sandbox(self, sandbox_id, reason: str | None = None) -> None:
        """Kill a sandbox; ``reason``: why, as its 404 will say it (default: killed by DELETE)."""
        self.sandboxes.kill(sandbox_id, endings.killed(sandbox_id, reason) if reason else None)

    def update_sandbox(self, sandbox_id, *, labels=None, remove_labels=(), memory_limit_mib=None) -> dict:
        """Add labels to a running sandbox (and take ``remove_labels`` off) and raise its memory limit
        (sandboxes.py)."""
        return self.sandboxes.update(sandbox_id, labels=labels, remove_labels=remove_labels,
                                     memory_limit_mib=memory_limit_mib)

    def memory(self, sandbox_id) -> dict:
        return self.sandboxes.memory(sandbox_id)

    def ping(self, sandbox_id, timeout: float = 5.0, wake: bool = True) -> dict:
        return self.sandboxes.ping(sandbox_id, timeout, wake)

    def sandbox_engine(self, sandbox_id) -> tuple:
        """(engine, handle) of a running sandbox, for managers that talk to its agent (404 if none)."""
        return self.sandboxes.engine_of(sandbox_id)

    def interrupt(self, sandbox_id) -> dict:
        return self.sandboxes.interrupt(sandbox_id)

    def inventory(self, sandbox_id) -> dict:
        """What a branch of the sandbox now would not carry: ``{"id", "engine", "lost": [...]}``."""
        return self.sandboxes.inventory(sandbox_id)

    def exec(self, sandbox_id, args, timeout_secs: float = 30, env: dict | None = None, cwd: str | None = None) -> dict:
        return self.sandboxes.exec(sandbox_id, args, timeout_secs, env=env, cwd=cwd)

    def eval(self, sandbox_id, code) -> dict:
        return self.sandboxes.eval(sandbox_id, code)

    def run_code(self, sandbox_id, code, timeout: float = 600) -> dict:
        return self.sandboxes.run_code(sandbox_id, code, timeout)

    def files(self, sandbox_id, op: str, path, **options) -> dict:
        return self.sandboxes.files(sandbox_id, op, path, **options)

    # --- tiers (tiers.py) ------------------------------------------------------------------------

    def freeze_sandbox(self, sandbox_id) -> dict:
        """Pause a sandbox, its memory kept and no CPU used (tier ``frozen``); the next call wakes it."""
        return self.tiers.freeze(sandbox_id)

    def store_sandbox(self, sandbox_id) -> dict:
        """Write a VM sandbox's state to the store and end its process (tier ``stored``)."""
        return self.tiers.store(sandbox_id)

    def wake_sandbox(self, sandbox_id) -> dict:
        """Make a frozen or stored sandbox running again; SandboxInfo plus ``wake`` (its figures)."""
        return self.tiers.wake(sandbox_id)

    # --- branch ----------------------------------------------------------------------------------

    def branch(self, sandbox_id, tag=None, *, mode=None, diff=False, live=False, measure_diff=False,
               wait=True, parent_tag=None, lossy=False, labels=None) -> dict:
        """Turn a running sandbox into a new snapshot, in forkd's check order.

        Returns SnapshotInfo; with ``wait=False`` it has status ``writing`` and turns ``ready`` or
        ``failed`` later (``wait_snapshot`` waits for that).
        """
        if tag is None:
            known = isinstance(sandbox_id, str) and self.registry.get_sandbox(sandbox_id) is not None
            seq = self.registry.next_counter(f"branch:{sandbox_id}") if known else 0
            tag = f"branch-{sandbox_id}-{seq}"
        check_tag(tag)
        release = self.branches.take_slot(tag)
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
            row = self.tiers.running_row(sandbox_id)  # a frozen or stored sandbox wakes first
            if parent_tag is not None and parent_tag != row["snapshot_tag"]:
                raise BadRequest(f"parent_tag {parent_tag!r} is not the source's snapshot {row['snapshot_tag']!r}")
            if parent_tag is not None and not diff:
                raise BadRequest("parent_tag needs diff mode")
            if not isinstance(lossy, bool):
                raise BadRequest(f"lossy must be true or false, got {lossy!r}")
            labels = check_labels(labels)
        except BaseException:
            release()
            raise
        mode = "live" if live else "diff" if diff else "full"
        return self.snapshot_info(self.branches.branch_into(row, tag, mode, release, wait=wait, lossy=lossy,
                                                            labels=labels))

    # --- fork trees (forktrees.py) ----------------------------------------------------------------

    def fork(self, sandbox_id, count, *, tag=None, labels=None, memory_limit_mib=None, lossy=False) -> dict:
        """Branch a running sandbox once and spawn ``count`` children of it, labelled with one
        ``fork_tree_id``: ``{"fork_tree_id", "snapshot", "sandboxes"}``."""
        return self.trees.fork(sandbox_id, count, tag=tag, labels=labels, memory_limit_mib=memory_limit_mib,
                               lossy=lossy)

    def promote(self, sandbox_id, tree_id=None, cleanup_siblings=True) -> dict:
        """The winner of its fork tree survives; its siblings are killed and the tree's snapshot is
        released when nothing needs it (never what another notebook, a workspace or a tag holds)."""
        return self.trees.promote(sandbox_id, tree_id, cleanup_siblings)

    def compact_snapshot(self, tag, to, *, labels=None) -> dict:
        """An independent copy of snapshot ``tag`` under ``to`` (forkd's compact), in forkd's order:
        unsafe tag 400, unsafe ``to`` 400, ``to == tag`` 400, the branch slot (409 in flight, 503 at
        the cap), ``to`` exists 409, unknown ``tag`` 404, engine failure 500.

        Snapshots here never form diff chains, so compacting is a copy: a sandbox of ``tag`` is
        branched (mode full) into ``to`` and killed. The copy is a root of its own lineage: deleting
        ``tag``, even with cascade, leaves it. No engine API beyond spawn, branch and kill.
        """
        check_tag(tag)
        check_tag(to, "to")
        labels = check_labels(labels)
        if to == tag:
            raise BadRequest(f"to must differ from the snapshot being compacted ({tag!r})")
        release = self.branches.take_slot(to)
        helper = None
        try:
            try:
                if self.registry.get_snapshot(to) is not None:
                    raise Conflict(f"snapshot {to} already exists; DELETE first")
                if self.registry.get_snapshot(tag) is None:
                    raise NotFound(f"snapshot {tag} not found")
                helper = self.spawn(tag, 1)[0]["id"]
                row = self.registry.get_sandbox(helper)
                if row is None or not self.sandboxes.alive(row):
                    raise EngineFailure(f"compact: the sandbox of {tag} to copy from ended before the copy")
            except BaseException:
                release()
                raise
            return self.snapshot_info(self.branches.branch_into(
                row, to, "full", release, lineage=[to], branched_from=f"compact:{tag}",
                spec={"compacted_from": tag, "mode": "full"}, record_pause=False, labels=labels))
        finally:
            if helper is not None:
                self.sandboxes.kill_quietly(helper)

    def label_snapshot(self, tag, labels: dict[str, str], remove: tuple[str, ...] = ()) -> dict:
        """Add ``labels`` to a snapshot and take the keys ``remove`` off (an admin's share and unshare)."""
        check_tag(tag)
        labels = check_labels(labels)
        row = self.registry.get_snapshot(tag)
        if row is None:
            raise NotFound(f"snapshot {tag} not found")
        merged = {k: v for k, v in {**(row.get("labels") or {}), **labels}.items() if k not in remove}
        self.registry.update_snapshot(tag, labels=check_labels(merged, f"the labels of {tag} with these"))
        self.feed.emit("snapshot", "updated", tag=tag)
        return self.get_snapshot(tag)

    # --- stores (stores.py) ----------------------------------------------------------------------

    def push_snapshot(self, tag) -> dict:
        """Push a ready VM snapshot to the remote store: {"digest", "store", "uploaded_chunks", ...}."""
        return self.stores.push(tag)

    def pull_snapshot(self, *, tag=None, digest=None) -> dict:
        """A ready snapshot on this host from the remote store, by tag or by digest."""
        return self.stores.pull(tag=tag, digest=digest)

    def delete_remote_snapshot(self, name) -> dict:
        """Delete a snapshot (by tag or digest) from the remote store, keeping chunks others use."""
        return self.stores.delete_remote(name)

    def wait_snapshot(self, tag, timeout: float = 60.0) -> dict:
        """Block until a snapshot is ``ready`` or ``failed``; returns its info."""
        check_tag(tag)
        return self.snapshot_info(self.branches.wait_snapshot(tag, timeout))

    # --- workspaces (workspaces.py) --------------------------------------------------------------

    state_tag = staticmethod(state_tag)
    workspace_info = staticmethod(workspace_info)

    def list_workspaces(self) -> list[dict]:
        self.recovery.check_workspaces()
        return self.workspaces.list()

    def get_workspace(self, name) -> dict:
        self.recovery.check_workspaces()
        return self.workspaces.get(name)

    def create_workspace(self, name, snapshot_tag, *, memory_limit_mib=None, labels=None, **_forkd_options) -> dict:
        """forkd's ``per_child_netns`` is accepted and ignored."""
        self.recovery.check_workspaces()
        return self.workspaces.create(name, snapshot_tag, memory_limit_mib=memory_limit_mib, labels=labels)

    def suspend_workspace(self, name, *, diff: bool = False) -> dict:
        self.recovery.check_workspaces()
        return self.workspaces.suspend(name, diff=diff)

    def resume_workspace(self, name) -> dict:
        self.recovery.check_workspaces()
        return self.workspaces.resume(name)

    def delete_workspace(self, name) -> None:
        self.recovery.check_workspaces()
        self.workspaces.delete(name)

    # --- lineage ---------------------------------------------------------------------------------

    def tree(self, labels: dict[str, str] | None = None) -> list[dict]:
        """Every snapshot and live sandbox as nodes with a parent id (None for roots). With
        ``labels``: the nodes carrying all of them and their ancestors, so the lineage stays whole."""
        nodes = tree_nodes([self.branches.overlay(r) for r in self.registry.list_snapshots()],
                           self.registry.list_sandboxes())
        recovering = self.recovery.unsettled()
        for node in nodes:  # shown, so the lineage stays whole, but not as what it may no longer be
            if node["id"] in recovering:
                node["status"] = "recovering"
        if not labels:
            return nodes
        keep = {a for n in nodes if has_labels(n["labels"], labels) for a in n["lineage"]}
        return [n for n in nodes if n["id"] in keep]
