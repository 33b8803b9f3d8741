"""Fork trees: try N copies of a sandbox, keep the one that worked, drop the rest.

``fork`` branches a running sandbox once (a live branch where its engine can, else a full one) and
spawns ``count`` children of that snapshot, each labelled ``fork_tree_id=<tree>``. ``promote``
names the winner: its siblings are killed, and the tree's own snapshot is released when nothing
needs it any more. The tree's record (members, their owners at fork time, its snapshot) lives in
the registry's database, so a restarted server can still promote.

What promote never touches, whatever the tree says:

- a sibling another notebook has taken: the HEAD of any forkd kernel, or one whose notebook labels
  (``jupyter.kernel_id`` / ``jupyter.notebook``) changed since the fork (a checkout made it theirs);
- a workspace's sandbox or state;
- the tree's snapshot when it was given a tag (``tag``: the user named it, so it is theirs), when it
  is a forkd kernel's base, or when a running sandbox other than the winner was spawned from it.
  Snapshots branched from the members are never the tree's to release.

A member's ``fork_tree_id`` label means "in an open tree": promote takes it off the survivors, and
branches of members do not inherit it (branching.py), so nothing outside the tree ever carries it.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from typing import TYPE_CHECKING

from . import endings
from .checks import MAX_CHILDREN, check_labels, check_tag, int_field, memory_limit
from ..errors import BadRequest, Conflict, ForkdError, NotFound
from .wire import FORK_TREE_LABEL, sandbox_info

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["FORK_TREE_LABEL", "ForkTreeManager"]

OWNER_LABELS = ("jupyter.kernel_id", "jupyter.notebook")  # who a sandbox is for (forkd_magics._scope)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS fork_trees (
    tree_id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    snapshot_tag TEXT NOT NULL,
    user_tag INTEGER NOT NULL,
    owners TEXT NOT NULL,
    members TEXT NOT NULL,
    status TEXT NOT NULL,
    winner TEXT,
    created_at REAL NOT NULL
)"""
FIELDS = ("tree_id", "source", "snapshot_tag", "user_tag", "owners", "members", "status", "winner", "created_at")
_JSON = {"owners", "members"}


def lost(tree_id: str, winner: str) -> str:
    """Why a sibling a promote killed ended, as its 404 says it (a router's promote says the same)."""
    return f"it lost fork tree {tree_id} to {winner}, which was promoted"


def _owners(labels: dict | None) -> dict:
    return {k: v for k, v in (labels or {}).items() if k in OWNER_LABELS}


class ForkTreeManager:
    def __init__(self, controller: "Controller"):
        self.ctl = controller
        self.registry = controller.registry
        self.kernels = None  # the server's KernelHeads (kernels.py), when a Jupyter server runs us
        self._lock = threading.Lock()
        self._promoting: dict[str, threading.Lock] = {}  # tree id -> held while it is being promoted
        with self.registry.tx() as db:
            db.execute(_SCHEMA)

    # --- the record ------------------------------------------------------------------------------

    def _write(self, row: dict, durable: bool = True) -> None:
        with self.registry.tx(durable) as db:
            db.execute(f"INSERT OR REPLACE INTO fork_trees ({', '.join(FIELDS)}) VALUES "
                       f"({', '.join('?' * len(FIELDS))})",
                       tuple(json.dumps(row[f]) if f in _JSON else row[f] for f in FIELDS))

    def _drop(self, tree_id: str) -> None:
        with self.registry.tx() as db:
            db.execute("DELETE FROM fork_trees WHERE tree_id=?", (tree_id,))

    def get(self, tree_id) -> dict:
        if not isinstance(tree_id, str) or not tree_id:
            raise BadRequest(f"tree_id must be a fork tree's id (a string like ft-1a2b3c4d5e), got {tree_id!r:.60}")
        with self.registry.tx() as db:
            found = db.execute(f"SELECT {', '.join(FIELDS)} FROM fork_trees WHERE tree_id=?", (tree_id,)).fetchone()
        if found is None:
            raise NotFound(f"fork tree {tree_id} not found",
                           hint="the fork's answer names its tree (fork_tree_id); so does each child's "
                                "fork_tree_id label (GET /v1/sandboxes/{id})")
        row = dict(zip(FIELDS, found))
        return {k: json.loads(v) if k in _JSON else v for k, v in row.items()}

    def members(self, tree: dict) -> list[str]:
        """The tree's children: recorded once spawned, and (should a crash have come between the
        spawn and that record) the sandboxes of its snapshot that carry its label."""
        labelled = [r["id"] for r in self.registry.list_sandboxes() if r["snapshot_tag"] == tree["snapshot_tag"]
                    and (r.get("labels") or {}).get(FORK_TREE_LABEL) == tree["tree_id"]]
        return list(dict.fromkeys([*tree["members"], *labelled]))

    # --- fork --------------------------------------------------------------------------------------

    def fork(self, sandbox_id, count, *, tag=None, labels=None, memory_limit_mib=None, lossy=False) -> dict:
        """Branch ``sandbox_id`` once and spawn ``count`` children of it, one tree: returns
        ``{"fork_tree_id", "snapshot", "sandboxes"}``."""
        int_field(count, "count", 1, MAX_CHILDREN, "children of one fork")
        if tag is not None:
            check_tag(tag)
        memory_limit_mib = memory_limit(memory_limit_mib)  # before the branch, which a refused spawn would waste
        labels = check_labels(labels)
        if FORK_TREE_LABEL in labels:
            raise BadRequest(f"labels: {FORK_TREE_LABEL} is set by the fork itself (one new tree per fork); "
                             f"leave it out")
        if not isinstance(lossy, bool):
            raise BadRequest(f"lossy must be true or false, got {lossy!r:.40}")
        source = self.ctl.sandboxes.row(sandbox_id)  # 404 (saying how it ended) before any work
        tree_id = "ft-" + secrets.token_hex(5)
        snapshot = self._branch(source["id"], tag or tree_id, lossy, labels)
        # Recorded before its children exist, so none is ever a member of no tree; ``owners``: whose
        # each child is when it starts (its labels are the snapshot's and these).
        tree = {"tree_id": tree_id, "source": source["id"], "snapshot_tag": snapshot["tag"],
                "user_tag": int(tag is not None), "owners": _owners({**snapshot["labels"], **labels}),
                "members": [], "status": "open", "winner": None, "created_at": time.time()}
        # A tree of processes (its snapshot too) dies with the host: its record need not wait for the disk.
        durable = not getattr(self.ctl.engines.get(snapshot["engine"]), "snapshots_are_processes", False)
        try:
            self._write(tree, durable)
            kids = self.ctl.spawn(snapshot["tag"], count, memory_limit_mib=memory_limit_mib,
                                  labels={**labels, FORK_TREE_LABEL: tree_id})
        except BaseException:  # no children: the branch made for them and the record go too
            with contextlib.suppress(Exception):  # the spawn's own error is the one to say
                if tag is None:
                    self._release(snapshot["tag"])
                self._drop(tree_id)
            raise
        self._write({**tree, "members": [k["id"] for k in kids]}, durable)
        return {"fork_tree_id": tree_id, "snapshot": snapshot, "sandboxes": kids}

    def _branch(self, sandbox_id: str, tag: str, lossy: bool, labels: dict) -> dict:
        """A live branch (the shortest pause of the source); a full one where the engine has no live."""
        try:
            return self.ctl.branch(sandbox_id, tag, mode="live", lossy=lossy, labels=labels)
        except BadRequest as exc:
            from forkd_engine import UnsupportedMode
            if not isinstance(exc.__cause__, UnsupportedMode):
                raise
        return self.ctl.branch(sandbox_id, tag, lossy=lossy, labels=labels)

    # --- promote -----------------------------------------------------------------------------------

    def promote(self, sandbox_id, tree_id=None, cleanup_siblings=True) -> dict:
        """``sandbox_id`` wins its fork tree: its siblings are killed (``cleanup_siblings``), the
        tree's snapshot is released if nothing needs it, and the tree closes. Returns ``{"fork_tree_id",
        "winner", "killed", "released", "kept", "failed"}`` (``kept``: what stayed, and why)."""
        if not isinstance(cleanup_siblings, bool):
            raise BadRequest(f"cleanup_siblings must be true or false, got {cleanup_siblings!r:.40}")
        winner = self.ctl.sandboxes.row(sandbox_id)
        if tree_id is None:
            tree_id = (winner.get("labels") or {}).get(FORK_TREE_LABEL)
            if tree_id is None:
                sid = winner["id"]
                raise BadRequest(f"sandbox {sid} is in no open fork tree",
                                 hint="fork a sandbox into a tree first, then keep one of its children",
                                 details={"rest": f'POST /v1/sandboxes/{sid}/fork {{"count": 3}}',
                                          "sdk": "kids = sandbox.fork(count=3); kids[0].promote()",
                                          "cli": f"forkd fork {sid} -n 3", "magic": f"kids = %forkd fork {sid} -n 3",
                                          "promoted": "a tree promoted already is named by tree_id"})
        with self._tree_lock(tree_id):  # one promote of a tree at a time: the second sees the first's result
            tree = self.get(tree_id)
            members = self.members(tree)
            if winner["id"] not in members:
                raise BadRequest(f"sandbox {winner['id']} is not in fork tree {tree_id}",
                                 hint=f"its members: {', '.join(sorted(members)) or 'none'}")
            if tree["status"] == "promoted" and tree["winner"] != winner["id"]:
                raise Conflict(f"fork tree {tree_id} was promoted already: {tree['winner']} won it",
                               hint=f"fork {winner['id']} again to start a new tree from it")
            killed, kept, failed = self._drop_siblings(tree, members, winner["id"], cleanup_siblings)
            released = self._release_snapshot(tree, winner["id"], kept)
            self._write({**tree, "members": members, "status": "promoted", "winner": winner["id"]})
            self._close_labels(tree, members)
        return {"fork_tree_id": tree_id, "winner": sandbox_info(self.registry.get_sandbox(winner["id"])),
                "killed": killed, "released": released, "kept": kept, "failed": failed}

    @contextlib.contextmanager
    def _tree_lock(self, tree_id: str):
        with self._lock:
            lock = self._promoting.setdefault(tree_id, threading.Lock())
        with lock:
            yield

    def _holders(self) -> tuple[dict[str, str], dict[str, str]]:
        """({sandbox: whose HEAD}, {snapshot: whose base}) of the forkd kernels this server knows."""
        heads, bases = {}, {}
        for k in (self.kernels.list() if self.kernels is not None else []):
            who = f"the notebook {k['notebook']}" if k.get("notebook") else f"the forkd kernel {k['kernel_id']}"
            heads[k["head"]] = who
            if k.get("base_snapshot"):
                bases[k["base_snapshot"]] = who
        return heads, bases

    def _drop_siblings(self, tree: dict, members: list[str], winner: str, cleanup: bool) -> tuple[list, list, list]:
        heads, _ = self._holders()
        workspaces = {w["live_sandbox_id"]: w["name"] for w in self.registry.list_workspaces() if w["live_sandbox_id"]}
        killed, kept, failed = [], [], []
        owners = tree["owners"]
        for sid in members:
            row = self.registry.get_sandbox(sid)
            if sid == winner or row is None or row.get("ending"):
                continue  # the winner, or gone already
            now = _owners(row.get("labels"))
            if sid in heads:
                why = f"it is the sandbox {heads[sid]} runs in (its HEAD)"
            elif now != owners:
                who = now.get("jupyter.notebook") or now.get("jupyter.kernel_id") or "someone else"
                why = f"it was taken over since the fork (now {who}'s)"
            elif sid in workspaces:
                why = f"it is the sandbox of workspace {workspaces[sid]}"
            elif not cleanup:
                why = "cleanup_siblings is false"
            else:
                try:
                    self.ctl.sandboxes.kill(sid, ended=endings.killed(sid, lost(tree["tree_id"], winner)))
                    killed.append(sid)
                except NotFound:
                    pass  # it ended meanwhile
                except ForkdError as exc:
                    failed.append({"id": sid, "error": exc.message})
                continue
            kept.append({"id": sid, "kind": "sandbox", "reason": why})
        return killed, kept, failed

    def _release_snapshot(self, tree: dict, winner: str, kept: list) -> list[str]:
        tag = tree["snapshot_tag"]
        row = self.registry.get_snapshot(tag)
        if row is None:
            return []
        _, bases = self._holders()
        users = [s["id"] for s in self.registry.list_sandboxes() if s["snapshot_tag"] == tag and s["id"] != winner
                 and not s.get("ending")]
        states = self.ctl.workspaces.state_holders()
        why = ("its tag was given by the fork's caller" if tree["user_tag"] else
               f"it is the base snapshot of {bases[tag]}" if tag in bases else
               f"it holds the state of workspace {states[tag]}" if tag in states else
               f"{', '.join(users)} {'was' if len(users) == 1 else 'were'} spawned from it" if users else None)
        if why is None:
            try:
                self._release(tag)
                return [tag]
            except ForkdError as exc:
                why = f"it could not be released: {exc.message}"
        kept.append({"id": tag, "kind": "snapshot", "reason": why})
        return []

    def _release(self, tag: str) -> None:
        try:
            self.ctl.delete_snapshot(tag)
        except NotFound:
            pass

    def _close_labels(self, tree: dict, members: list[str]) -> None:
        """The tree is decided: its survivors are members of no open tree any more."""
        for sid in members:
            row = self.registry.get_sandbox(sid)
            labels = (row or {}).get("labels") or {}
            if row is not None and labels.get(FORK_TREE_LABEL) == tree["tree_id"]:
                labels = {k: v for k, v in labels.items() if k != FORK_TREE_LABEL}
                self.registry.update_sandbox(sid, labels=labels)
                self.ctl.feed.emit("sandbox", "updated", id=sid, labels=labels)

