"""Snapshots that last and travel: every ready VM snapshot kept in this host's chunk store, and
push/pull between it and a remote store (``forkd serve --store URL``).

- *Durable by default*: when a VM snapshot becomes ready, a background thread writes its files
  into the engine's local store (``forkd_engine.store``; one snapshot at a time, off every
  request's path) and records ``stored`` (its manifest digest) on it. After a reboot, whose tmpfs
  lost ``memory.bin``, the snapshot is still ``ready`` and its first spawn writes the file back.
  A snapshot still unstored when the server stopped is stored when it starts again.
- *Push* copies a stored snapshot's missing chunks to the remote, then its manifest, then its tag;
  *pull* fetches a manifest by tag or digest, checks this host can restore it (409 naming the field
  that differs), fetches only the chunks this host lacks, verifying each once as it writes it into
  the snapshot's files (and keeps it in the local store), and makes a ``ready`` snapshot of it.
- A stored sandbox's copy in the remote store goes once it runs again or ends (stored_copies.py).

Progress goes out as change events (kind snapshot, action ``push``/``pull``, ``done_bytes`` and
``total_bytes``). A store that fails is a 502 naming the store and what failed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time

from forkd_engine import EngineError
from forkd_engine.store import (ChunkCorrupt, Incompatible, NotInStore, RemoteStore, StoreError, delete as delete_remote,
                                fetch_manifest, parse_digest, push as push_chunks)

from .checks import check_tag
from ..errors import BadRequest, Busy, Conflict, EngineFailure, NotFound, StoreFailure
from .stored_copies import StoredCopies

PROGRESS_EVERY = 0.25  # seconds between progress events of one transfer
# A remote delete sweeps no chunk younger than this (s): a push under way writes its chunks before
# its manifest. $FORKD_STORE_DELETE_GRACE sets another (0 only where nothing else pushes).
DELETE_GRACE = 3600.0
CLOSE_WAIT = 30.0  # seconds close() waits for a transfer under way to reach its next chunk


class Closing(Busy):
    """The controller is closing: a transfer under way stops at its next chunk. The next start
    stores what was not stored (``resume``) and resumes a push it cut short."""


class StoreManager:
    def __init__(self, controller, store_url: str | None = None, store_options: dict | None = None):
        self.ctl = controller
        self.registry = controller.registry
        self.feed = controller.feed
        self.remote = None
        self.grace_seconds = float(os.environ.get("FORKD_STORE_DELETE_GRACE") or DELETE_GRACE)
        if store_url:
            options = dict(store_options or {})
            try:
                self.remote = RemoteStore(store_url, timeout=options.pop("timeout", None), **options)
            except StoreError as exc:
                raise BadRequest(str(exc)) from None
        self._queue: queue.Queue[tuple[str, str] | None] = queue.Queue()  # ("store" | "push", tag)
        # a push under way leaves a marker: one cut short (the server killed) resumes at start-up
        self._pushing_dir = os.path.join(controller.data_dir, "pushing")
        os.makedirs(self._pushing_dir, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._pending: set[str] = set()
        self._failed_pushes: set[str] = set()  # tags whose last push a store error cut short
        self._worker = threading.Thread(target=self._work, name="forkd-store", daemon=True)
        self._worker.start()
        self.stored_copies = StoredCopies(self)  # a woken or ended sandbox's stored state leaves the remote

    # --- durable by default ----------------------------------------------------------------------

    def _engine_of(self, row: dict):
        engine = self.ctl.engines.get(row["engine"])
        return engine if engine is not None and hasattr(engine, "store_snapshot") else None

    def store_later(self, tag: str) -> None:
        """Queue snapshot ``tag`` for the local store (a no-op for engines without files)."""
        row = self.registry.get_snapshot(tag)
        if row is None or self._engine_of(row) is None or (row["handle"] or {}).get("stored"):
            return
        with self._lock:
            if tag in self._pending:
                return
            self._pending.add(tag)
        self._queue.put(("store", tag))

    def resume(self) -> list[str]:
        """At start-up: drop pins no snapshot owns any more (their chunks become cache), store every
        ready snapshot the previous server had not stored yet, and resume the pushes it was cut off
        in. Returns one line per resumed push."""
        rows = self.registry.list_snapshots()
        for name, engine in self.ctl.engines.items():
            if hasattr(engine, "store_snapshot"):
                owned = {(r["handle"] or {}).get("tag") for r in rows if r["engine"] == name}
                owned |= {h.get("tag") for h in self.ctl.tiers.stored_handles()}  # stored sandboxes' states
                for pin in set(engine.store.pins()) - owned:
                    engine.store.unpin(pin)
        for row in rows:
            if row["status"] == "ready":
                self.store_later(row["tag"])
        found = []
        for tag in sorted(os.listdir(self._pushing_dir)):
            row = self.registry.get_snapshot(tag)
            if row is None or row["status"] != "ready" or self.remote is None:
                os.unlink(os.path.join(self._pushing_dir, tag))
                found.append(f"snapshot {tag}: a push was cut short by the server's end; not resumed "
                             f"({'no remote store now' if self.remote is None else 'the snapshot is gone'})")
                continue
            with self._lock:
                self._pending.add(f"push:{tag}")
            self._queue.put(("push", tag))
            found.append(f"snapshot {tag}: a push to {self.remote.url} was cut short by the server's end; it "
                         f"resumes now (only the chunks the store lacks)")
        return found + self.stored_copies.resume()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued for the local store; True if so within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Stop the workers and wait for them (``CLOSE_WAIT`` each at most): a transfer under way stops
        at its next chunk and what is queued is left for the next start, so nothing writes into the
        data dir, or uses the registry, once the controller has closed."""
        self._closing.set()
        self._queue.put(None)
        self._worker.join(CLOSE_WAIT)
        self.stored_copies.close(CLOSE_WAIT)

    def _unless_closing(self, done: int, total: int) -> None:
        if self._closing.is_set():
            raise Closing("the server is stopping: this transfer stopped at a chunk's end",
                          hint="a snapshot not stored yet is stored, and a push resumed, when the server starts "
                               "again; a pull can be asked again then")

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            kind, tag = job
            try:
                if self._closing.is_set():
                    continue  # left for the next start (resume)
                if kind == "store":
                    self.store_now(tag)
                else:
                    self.push(tag)
            except Exception:  # noqa: BLE001 - said on the feed: a stored warning, or push progress that stops
                pass
            finally:
                with self._idle:
                    self._pending.discard(tag if kind == "store" else f"push:{tag}")
                    self._idle.notify_all()

    def store_now(self, tag: str) -> dict | None:
        """Write snapshot ``tag`` into the local store now, unless it is there; returns its
        ``stored`` object (None for an engine without files or a snapshot not ready)."""
        row = self.registry.get_snapshot(tag)
        if row is None or row["status"] != "ready" or self._engine_of(row) is None:
            return None
        handle = row["handle"] or {}
        if handle.get("stored"):
            return handle["stored"]
        engine = self._engine_of(row)
        if not engine.alive(handle):
            return None
        try:
            digest = engine.store_snapshot(handle, progress=self._unless_closing)
        except EngineError as exc:
            self.feed.emit("snapshot", "stored", tag=tag, warning=f"not kept in the local store: {exc}")
            raise
        stored = {"digest": digest, "remote": False}
        self._set_stored(tag, handle, stored)
        self.feed.emit("snapshot", "stored", tag=tag, digest=digest, remote=False)
        return stored

    def _set_stored(self, tag: str, handle: dict, stored: dict) -> None:
        with self._lock:
            row = self.registry.get_snapshot(tag)
            if row is not None and (row["handle"] or {}).get("tag") == handle.get("tag"):
                self.registry.update_snapshot(tag, handle=dict(row["handle"], stored=stored))

    # --- remote stores ---------------------------------------------------------------------------

    def _remote(self) -> RemoteStore:
        if self.remote is None:
            raise BadRequest("this server has no remote store",
                             hint="start it with `forkd serve --store s3://bucket/prefix` (or file://, gs://, az://), "
                                  "or set c.ForkdApp.store")
        return self.remote

    def _progress(self, tag: str, action: str):
        last = [0.0]

        def report(done: int, total: int) -> None:
            self._unless_closing(done, total)
            now = time.monotonic()
            if done >= total or now - last[0] >= PROGRESS_EVERY:
                last[0] = now
                self.feed.emit("snapshot", action, tag=tag, done_bytes=done, total_bytes=total)
        return report

    def push(self, tag) -> dict:
        """Push snapshot ``tag`` to the remote store; returns the push's figures and its digest."""
        check_tag(tag)
        remote = self._remote()
        row = self.registry.get_snapshot(tag)
        if row is None:
            raise NotFound(f"snapshot {tag} not found")
        if row["status"] != "ready":
            raise Conflict(f"snapshot {tag} is {row['status']}; only a ready snapshot can be pushed")
        if self._engine_of(row) is None:
            raise Conflict(f"snapshot {tag} is a {row['engine']}-engine snapshot: a parked process, not files, so "
                           f"it cannot be pushed", hint="snapshots of the vm engine can be pushed")
        try:
            stored = self.store_now(tag)
        except EngineError as exc:
            raise EngineFailure(f"push of {tag}: {exc}") from exc
        if stored is None:
            raise Conflict(f"snapshot {tag}: its files are gone, nothing to push")
        engine = self._engine_of(row)
        marker = os.path.join(self._pushing_dir, tag)
        # a push cut short (this server's end, or a store that failed) left part of it in the store:
        # look each chunk up before sending it, rather than send what the store may hold
        cut_short = os.path.exists(marker) or tag in self._failed_pushes
        open(marker, "w").close()
        try:
            result = push_chunks(engine.store, remote, stored["digest"], tag=tag, progress=self._progress(tag, "push"),
                                 held=self.held_remotely(engine), look_first=cut_short)
        except Closing:
            marker = None  # kept: the next start resumes this push
            raise
        except StoreError as exc:
            self._failed_pushes.add(tag)
            # chunks are whole or absent and the manifest goes last: nothing a pull would use is half there
            raise StoreFailure(f"push of {tag}: {exc}",
                               hint=f"{tag} is unharmed here, and the store holds no manifest of it until a push "
                                    f"completes; pushing again uploads only the chunks the store lacks") from None
        finally:
            if marker is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(marker)
        self._failed_pushes.discard(tag)
        self._set_stored(tag, row["handle"], dict(stored, remote=True))
        self.feed.emit("snapshot", "stored", tag=tag, digest=stored["digest"], remote=True)
        return {"tag": tag, "store": remote.url, **result}

    def held_remotely(self, engine) -> set[str]:
        """The chunks the remote store is believed to hold: those of this host's snapshots and stored
        sandboxes that were pushed to it or pulled from it (a diff branch shares most of its parent's).
        A push looks these up before sending them and sends the others at once; a belief gone stale
        costs a lookup or a refused send, never a chunk missing, as every write is in create mode."""
        stored = [(r["handle"] or {}).get("stored") for r in self.registry.list_snapshots()]
        stored += [r.get("stored") for r in self.registry.list_sandboxes()]
        digests = {s.get("digest") for s in stored if s and s.get("remote")}
        held: set[str] = set()
        for digest in digests - {None}:
            manifest = engine.store.get_manifest(digest)
            if manifest is not None:
                held.update(manifest.chunks())
        return held

    def delete_remote(self, name) -> dict:
        """Delete a snapshot from the remote store, by tag or ``sha256:`` digest: its manifest and the
        tags naming it, then (mark and sweep) every chunk no remaining manifest lists and older than
        the grace period. Snapshots on this host stay; those that named it are no longer ``remote``,
        also when the store no longer holds it (another host of the store deleted it: a 404)."""
        if not isinstance(name, str) or not name:
            raise BadRequest("give a tag or a sha256: digest")
        try:  # the reference first: a bad one is a 400 whether or not this server has a store
            digest = "sha256:" + parse_digest(name) if name.startswith("sha256:") else None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if digest is None:
            check_tag(name)
        remote = self._remote()
        try:
            if digest is None:
                digest = remote.get_tag(name)
            fetch_manifest(remote, digest=digest)  # a 404 for a snapshot the store does not hold
            figures = delete_remote(remote, digest, grace_seconds=self.grace_seconds)
        except NotInStore as exc:
            self._not_remote(remote, digest, name)
            raise NotFound(str(exc)) from None
        except StoreError as exc:
            raise StoreFailure(f"delete of {name} from the store: {exc}") from None
        self._not_remote(remote, digest)
        return {"digest": digest, "store": remote.url, **figures}

    def _not_remote(self, remote: RemoteStore, digest: str | None, tag: str | None = None) -> None:
        """This host's snapshots of ``digest`` (or, when the store no longer knows the tag, the
        snapshot ``tag`` if its manifest is gone from the store) are no longer ``remote``."""
        for row in self.registry.list_snapshots():
            stored = (row["handle"] or {}).get("stored") or {}
            if not stored.get("remote"):
                continue
            if digest is None:  # the tag is gone from the store: is its manifest, too?
                if row["tag"] != tag:
                    continue
                try:
                    if remote.has(f"manifests/{parse_digest(stored['digest'])}"):
                        continue
                except StoreError:
                    continue  # the store cannot say: the mark stays
            elif stored.get("digest") != digest:
                continue
            self._set_stored(row["tag"], row["handle"], dict(stored, remote=False))
            self.feed.emit("snapshot", "stored", tag=row["tag"], digest=stored["digest"], remote=False)

    def pull(self, tag=None, digest=None) -> dict:
        """Make a ready snapshot on this host from the remote store, by ``tag`` or ``digest``;
        returns its SnapshotInfo with the pull's figures under ``pull``."""
        remote = self._remote()
        if (tag is None) == (digest is None):
            raise BadRequest('give exactly one of "tag" and "digest"')
        if tag is not None:
            check_tag(tag)
        else:
            try:
                digest = "sha256:" + parse_digest(digest)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        try:
            manifest = fetch_manifest(remote, tag=tag, digest=digest)
        except NotInStore as exc:
            raise NotFound(str(exc), hint="push it there first, from a server of the same store that has it",
                           details={"cli": f"forkd push {tag or 'TAG'}", "rest": "POST /v1/snapshots/{tag}/push",
                                    "sdk": "push_snapshot(tag)"}) from None
        except StoreError as exc:
            raise StoreFailure(f"pull: {exc}") from None
        name = tag or manifest.meta.get("tag")
        check_tag(name)
        engine = self.ctl.engines.get("vm")
        if engine is None:
            raise Conflict(f"snapshot {name} is a VM snapshot and this server cannot run the vm engine "
                           f"({self.ctl.unavailable.get('vm', 'not available')})")
        try:
            manifest.check(engine.host_requires())
        except Incompatible as exc:
            raise Conflict(f"pull of {name}: {exc}", field=exc.field, wanted=exc.wanted, have=exc.have) from None
        with self.ctl.branches.reserve(name, f"snapshot {name} is already being written"):
            existing = self.registry.get_snapshot(name)
            if existing is not None:
                if ((existing["handle"] or {}).get("stored") or {}).get("digest") == manifest.digest:
                    return self.ctl.snapshot_info(existing)  # already here: pulling again changes nothing
                raise Conflict(f"snapshot {name} already exists on this host (another snapshot)",
                               hint=f"delete it first (DELETE /v1/snapshots/{name})")
            self.registry.insert_snapshot({"tag": name, "engine": "vm", "status": "writing", "created_at": time.time(),
                                           "lineage": [name],
                                           "spec": {"pulled_from": remote.url, "digest": manifest.digest}})
            self.feed.emit("snapshot", "created", tag=name, status="writing")
            try:
                # one pass: each missing chunk fetched, verified, written into its file and kept
                handle, figures = engine.import_snapshot(manifest, name, [name], remote=remote,
                                                         progress=self._progress(name, "pull"))
            except BaseException as exc:
                engine.store.unpin(name)
                engine.store.evict()  # what the pull fetched is cache now, within the cap
                self.registry.delete_snapshot(name)
                self.feed.emit("snapshot", "deleted", tag=name)
                if isinstance(exc, ChunkCorrupt):
                    raise StoreFailure(f"pull of {name}: {exc}", chunk=exc.chunk) from None
                if isinstance(exc, StoreError):
                    raise StoreFailure(f"pull of {name}: {exc}") from None
                if isinstance(exc, Incompatible):
                    raise Conflict(f"pull of {name}: {exc}", field=exc.field) from None
                if isinstance(exc, EngineError):
                    raise EngineFailure(f"pull of {name}: {exc}") from exc
                raise
            handle["stored"] = {"digest": manifest.digest, "remote": True}
            self.registry.update_snapshot(name, status="ready", handle=handle)
            self.feed.emit("snapshot", "status", tag=name, status="ready")
            return dict(self.ctl.snapshot_info(self.registry.get_snapshot(name)), pull=figures)
