"""The lineage widget: snapshots and sandboxes as one tree that follows ``/v1/events`` live.

The whole tree is one synced trait, ``tree = {id: node}``; a node is ``{"kind", "parent", "lineage",
"status", "history", "created", "engine", "pause_ms", "warnings", "labels", "info"}``, plus ``host`` (and a
snapshot's ``hosts``) behind a fleet's router. ``parent`` is
the direct parent the server records (``branched_from`` for a branch, ``snapshot_tag`` for a
sandbox) even when it is gone: the drawing (``lineage.js``, shared with the JupyterLab panel) puts
a ghost there, so lineage never breaks.

A thread in the kernel reads the event stream and reassigns ``tree`` on every change, so a status
badge moves from ``writing`` to ``ready`` without re-running a cell. A node that leaves the server
stays in ``tree`` as a tombstone (``"tomb": True``, status ``killed`` / ``deleted``) until the view's
"clear gone": the kernel keeps them, not the page, so a view drawn after they went (Run All reaches
a notebook's clean-up before the page has drawn its tree) shows the same tree as one that watched. The buttons (branch, fork n,
kill, delete) send a custom message ``{action, id, req, ...}``; the kernel runs the action through
the SDK and answers ``{reply: req, ok, message}``; a request without an answer (a kernel gone or
stuck) times out in the page, which then says "disconnected" and offers ``ping``. ``reconnect``
follows the server again after the stream was lost. The output bundle also carries a static SVG of the tree
(``_static.py``) for pages that cannot run the widget.
"""

from __future__ import annotations

import pathlib
import re
import threading
import time

import anywidget
import traitlets

from forkd_server.client import Controller, ControllerError, ServerUnreachable, unanswered

from ._scope import Scope
from ._static import host_label, static_bundle

_HERE = pathlib.Path(__file__).parent
BRANCH_MODES = ("live", "diff", "full")
GONE = {"sandbox": "killed", "snapshot": "deleted"}  # the status of a tombstone, as lineage_tree.js
# the drawing's modules, each importing the ones before it (the lab extension bundles the same files)
ESM_FILES = ("lineage_tree.js", "lineage.js", "lineage_widget.js")
_RELATIVE = re.compile(r'^(?:import\s*\{[^}]*\}\s*from|export \* from)\s*"\./[\w.]+";\n', re.M)


def widget_esm() -> str:
    """One ES module for anywidget, which loads a single file: the drawing's files in order, with
    their relative imports taken out (what they import is then defined above them)."""
    return "\n".join(_RELATIVE.sub("", (_HERE / name).read_text()) for name in ESM_FILES)


def _warnings(info: dict) -> list[str]:
    """A node's warnings: the lossy-fork ``warnings`` list, or a failed snapshot's ``warning``."""
    found = list(info.get("warnings") or [])
    if info.get("warning") and info["warning"] not in found:
        found.append(info["warning"])
    return found


def _history(seen: list[str] | None, status: str) -> list[str]:
    """The statuses a node went through, ending with its current one."""
    seen = list(seen or [])
    if not seen or seen[-1] != status:
        seen.append(status)
    return seen


def _where(item: dict) -> dict:
    """Behind a fleet's router: the host that holds it (``host``) and, for a snapshot, every host
    that does (``hosts``); nothing from one server."""
    out = {}
    if isinstance(item.get("host"), str):
        out["host"] = item["host"]
    if isinstance(item.get("hosts"), list) and item["hosts"]:
        out["hosts"] = [h for h in item["hosts"] if isinstance(h, str)]
    return out


def build_tree(snapshots: list[dict], sandboxes: list[dict], history: dict[str, list[str]]) -> dict:
    """Turn the API's snapshot and sandbox lists into the widget's ``{id: node}``."""
    tree = {}
    for s in snapshots:
        lineage = s.get("lineage") or [s["tag"]]
        status = s.get("status", "ready")
        tree[s["tag"]] = {
            "kind": "snapshot", "parent": lineage[-2] if len(lineage) > 1 else None, "lineage": lineage,
            "status": status, "history": _history(history.get(s["tag"]), status),
            "created": s.get("created_at_unix"), "engine": s.get("engine"), "pause_ms": s.get("pause_ms"),
            "warnings": _warnings(s), "labels": s.get("labels") or {}, "info": s,
            **({"stored": s["stored"]} if s.get("stored") else {}),  # kept in the store (remote: pushed)
            **_where(s),
        }
    for b in sandboxes:
        lineage = b.get("lineage") or [b["snapshot_tag"], b["id"]]
        status = b.get("status", "running")
        tree[b["id"]] = {
            "kind": "sandbox", "parent": b.get("snapshot_tag") or (lineage[-2] if len(lineage) > 1 else None),
            "lineage": lineage, "status": status, "history": _history(history.get(b["id"]), status),
            "created": b.get("created_at_unix"), "engine": b.get("engine"), "pause_ms": None,
            "warnings": _warnings(b), "labels": b.get("labels") or {}, "info": b,
            "tier": b.get("tier") or "running", **_where(b),
        }
    return tree


class LineageWidget(anywidget.AnyWidget):
    """The lineage tree of a forkd server, live. ``LineageWidget()`` finds the server like the SDK.

    ``scope``: show only what it holds (a notebook's nodes, see ``_scope``) and their ancestors, so the
    lineage stays whole; None shows everything. ``labels`` go on what its buttons create."""

    _esm = widget_esm()
    _css = _HERE / "lineage.css"

    tree = traitlets.Dict().tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    live = traitlets.Bool(False).tag(sync=True)
    server = traitlets.Unicode("").tag(sync=True)

    def __init__(self, controller: Controller | None = None, *, live: bool = True, scope: Scope | None = None,
                 labels: dict[str, str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.controller = controller or Controller()
        self.scope = None if scope is None or scope.everything else scope
        self._outside: set[str] = set()
        self.labels = dict(labels or {})
        self.server = self.controller.base_url
        self._lock = threading.RLock()
        self._history: dict[str, list[str]] = {}
        self._gone: dict[str, dict] = {}  # tombstones: nodes that left the server, until "clear gone"
        self._stream = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.on_msg(self._on_custom_msg)
        if live:
            self.start()
        else:
            self.refresh()

    def _repr_mimebundle_(self, **kwargs):
        """The live view, plus the tree as it is now for pages that do not run the widget (static.py)."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        with self._lock:
            tree = dict(self.tree)
        return {**data, **static_bundle(tree)}, metadata

    def __repr__(self) -> str:
        counts = {}
        for node in self.tree.values():
            key = "gone" if node.get("tomb") else node["kind"]
            counts[key] = counts.get(key, 0) + 1
        snaps, sbs, gone = counts.get("snapshot", 0), counts.get("sandbox", 0), counts.get("gone", 0)
        return (f"LineageWidget({self.server!r}: {snaps} snapshot{'' if snaps == 1 else 's'}, "
                f"{sbs} sandbox{'' if sbs == 1 else 'es'}{f', {gone} gone' if gone else ''}"
                f"{f' of {self.scope}' if self.scope else ''}{', live' if self.live else ''})")

    # --- state ---------------------------------------------------------------------------------

    def refresh(self) -> dict:
        """Re-read every snapshot and sandbox from the server; returns the new tree."""
        snapshots = self.controller.list_snapshots()
        sandboxes = self.controller.list_sandboxes()
        try:  # which sandbox each forkd kernel runs its notebook in (a server without /v1/kernels: none)
            kernels = self.controller.list_kernels()
        except (ControllerError, ServerUnreachable):
            kernels = []
        missing = unanswered(snapshots, sandboxes)
        with self._lock:
            tree = build_tree(snapshots, sandboxes, self._history)
            self._keep_unanswered(tree, missing)
            on_server = set(tree)
            head_kernels: dict[str, list[str]] = {}
            for k in kernels:
                head_kernels.setdefault(k.get("head"), []).append(k["kernel_id"])
                node = tree.get(k.get("head"))
                if node is not None:
                    node.setdefault("heads", []).append(k.get("notebook") or f"kernel {k['kernel_id'][:8]}")
            if self.scope is not None:
                tree = self._within_scope(tree, head_kernels)
            for node_id, node in tree.items():
                self._history[node_id] = node["history"]
            for gone in set(self._history) - set(tree):
                del self._history[gone]
            self._bury(tree, on_server)
            self.tree = {**self._gone, **tree}  # traits sync on assignment: always a new dict
        return self.tree

    def _keep_unanswered(self, tree: dict, missing: dict[str, str]) -> None:
        """Behind a router, a host that did not answer in time is missing from the lists, not
        emptied: what it held stays drawn as last seen, marked (never buried as killed or deleted)."""
        for node_id, node in self.tree.items():
            silent = next((h for h in node.get("hosts") or [node.get("host")] if h in missing), None)
            if node_id not in tree and silent and not node.get("tomb"):
                tree[node_id] = {**node, "unanswered": f"{host_label(silent)}: {missing[silent]}"}

    def _bury(self, tree: dict, on_server: set[str]) -> None:
        """Keep what left the server as tombstones; a node that only left the scope (a HEAD the
        notebook moved away from) is not gone, and a tag made again is not a tombstone any more."""
        now = time.time()
        for node_id, node in self.tree.items():
            if node_id not in tree and node_id not in on_server and not node.get("tomb"):
                status = GONE[node["kind"]]
                self._gone[node_id] = {**node, "status": status, "tomb": True, "gone_at": now, "heads": [],
                                       "history": _history(node.get("history"), status)}  # nobody's HEAD now
        for node_id in on_server & set(self._gone):
            del self._gone[node_id]

    def clear_gone(self) -> None:
        """Forget the tombstones (the view's "clear gone")."""
        with self._lock:
            self._gone.clear()
            self.tree = {k: v for k, v in self.tree.items() if not v.get("tomb")}

    def _within_scope(self, tree: dict, head_kernels: dict[str, list[str]]) -> dict:
        """The scope's nodes and their ancestors (context, as in the lab panel's "this notebook")."""
        keep: set[str] = set()
        for node_id, node in tree.items():
            if self.scope.matches(node["labels"], head_kernels.get(node_id, ())):
                keep.update(node["lineage"])
                keep.add(node_id)
        self._outside = set(tree) - keep  # their status changes need no re-read
        return {node_id: node for node_id, node in tree.items() if node_id in keep}

    def apply_event(self, event: dict) -> None:
        """Fold one ``/v1/events`` event into the tree (new nodes are read from the server)."""
        if event.get("kind") == "kernel":  # a notebook's HEAD moved: take the server's view
            self.refresh()
            return
        node_id = event.get("tag") if event.get("kind") == "snapshot" else event.get("id")
        action, status = event.get("action"), event.get("status")
        with self._lock:
            if node_id in self._outside and action != "updated":  # another notebook's (it becomes ours only
                return                                                # by new labels; HEAD moves are kernel events)
            if node_id in self._gone and action not in ("created", "updated"):
                return  # a late status of what is gone (a snapshot's template ending as it is deleted)
            if status and node_id:
                seen = self._history.setdefault(node_id, [])
                if not seen or seen[-1] != status:
                    seen.append(status)
            if action in ("created", "killed", "deleted", "updated") or node_id not in self.tree:
                self.refresh()  # structure or labels changed: take the server's view (lineage, details)
                return
            node = dict(self.tree[node_id], status=status or self.tree[node_id]["status"],
                        history=list(self._history.get(node_id, [])))
            if event.get("pause_ms") is not None:
                node["pause_ms"] = event["pause_ms"]
            if event.get("warning") or event.get("warnings"):
                node["info"] = dict(node["info"], **{k: event[k] for k in ("warning", "warnings") if event.get(k)})
                node["warnings"] = _warnings(node["info"])
            if status:
                node["info"] = dict(node["info"], status=status)
            if action == "tier" and event.get("tier"):  # running, frozen or stored
                node["tier"] = event["tier"]
            if action == "stored" and event.get("digest"):
                node["stored"] = {"digest": event["digest"], "remote": bool(event.get("remote"))}
            self.tree = {**self.tree, node_id: node}

    # --- live updates --------------------------------------------------------------------------

    def start(self) -> None:
        """Subscribe to ``/v1/events`` (open before this returns), read the tree, follow changes."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopped = False
        self._stream = self.controller.events()
        self.refresh()
        self._thread = threading.Thread(target=self._follow, name="forkd-lineage", daemon=True)
        self._thread.start()
        self.live = True

    def stop(self) -> None:
        """Stop following events (the tree stays as it is)."""
        self._stopped = True
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._thread = None
        self.live = False

    def close(self) -> None:
        self.stop()
        super().close()

    def _follow(self) -> None:
        stream = self._stream
        retries = 0
        while not self._stopped:
            try:
                for event in stream:
                    retries = 0
                    self.apply_event(event)
            except (OSError, ValueError, ControllerError) as exc:
                self.message = f"event stream interrupted: {exc}"
            if self._stopped:
                break
            # the server closed the stream (restart, shutdown): wait for it to answer /healthz again
            # (bounded), subscribe anew and re-read the tree; give up after a few tries (the view
            # then says "disconnected" and offers to reconnect)
            retries += 1
            if retries > 3:
                self.message = f"lost the server at {self.server}; reconnect when it is back"
                break
            try:
                self.controller.wait_ready(timeout=10)
                stream = self._stream = self.controller.events()
                self.refresh()
                self.message = ""
            except (ServerUnreachable, ControllerError, OSError) as exc:
                self.message = f"lost the server at {self.server} ({exc}); reconnect when it is back"
                break
        self.live = False

    # --- actions from the buttons ---------------------------------------------------------------

    def _on_custom_msg(self, _widget, content, _buffers) -> None:
        if not isinstance(content, dict) or "action" not in content:
            return
        action = content["action"]
        if action == "ping":  # is the kernel there? answer at once, touch nothing
            ok, message = True, "pong"
        elif action == "reconnect":
            ok, message = self.reconnect()
        elif action == "clear":
            self.clear_gone()
            ok, message = True, ""
        else:
            message = self.act(action, content.get("id", ""), n=content.get("n", 1),
                               mode=content.get("mode") or "live", cascade=bool(content.get("cascade")))
            ok = not message.startswith("error")
            self.message = message
        if "req" in content:
            self.send({"reply": content["req"], "ok": ok, "message": message})

    def reconnect(self) -> tuple[bool, str]:
        """Follow the server again (after the stream was lost); (ok, what happened)."""
        self.stop()
        try:
            self.start()
        except (ServerUnreachable, ControllerError, OSError) as exc:
            self.live = False
            self.message = f"still cannot reach {self.server}: {exc}"
            return False, self.message
        self.message = ""
        return True, f"following {self.server} again"

    def act(self, action: str, node_id: str, n: int = 1, mode: str = "live", cascade: bool = False) -> str:
        """Run a button's action through the SDK; returns the line shown under the tree."""
        ctl = self.controller
        try:
            if action == "branch":
                if mode not in BRANCH_MODES:
                    return f"error: branch {node_id}: unknown mode {mode!r} (use {', '.join(BRANCH_MODES)})"
                # live returns while memory is still being written (writing -> ready follows as
                # events); diff and full copy in the pause, so the server answers when they are done
                info = ctl.branch_sandbox(node_id, mode=mode, wait=mode != "live", labels=self.labels)
                msg = f"branched {node_id} into {info['tag']} (paused {info.get('pause_ms', 0):.1f} ms)"
            elif action == "fork":
                n = int(n)
                kids = ctl.spawn_sandboxes(node_id, n, labels=self.labels)
                msg = f"forked {len(kids)} sandbox{'es' if len(kids) != 1 else ''} from {node_id}"
            elif action == "kill":
                ctl.kill_sandbox(node_id)
                msg = f"killed {node_id}"
            elif action == "keep":  # the winner of its fork tree: its siblings go
                done = ctl.promote_sandbox(node_id)
                msg = "; ".join([f"kept {node_id}: killed {len(done['killed'])} sibling"
                                 f"{'' if len(done['killed']) == 1 else 's'}",
                                 *([f"released {', '.join(done['released'])}"] if done["released"] else []),
                                 *(f"kept {k['id']} ({k['reason']})" for k in done["kept"]),
                                 *(f"could not kill {f['id']}: {f['error']}" for f in done["failed"])])
            elif action == "delete":
                ctl.delete_snapshot(node_id, cascade=cascade)
                msg = f"deleted {node_id}" + (" and the snapshots branched from it" if cascade else "")
            elif action == "refresh":
                self.refresh()
                return "refreshed"
            else:
                return f"error: unknown action {action!r}"
        except ControllerError as exc:
            return f"error: {action} {node_id}: {exc.message}"
        except (ServerUnreachable, ValueError, TypeError) as exc:
            return f"error: {action} {node_id}: {exc}"
        if not self.live:
            self.refresh()
        return msg
