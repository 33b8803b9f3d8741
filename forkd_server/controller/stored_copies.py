"""A stored sandbox's copy in the remote store: its state while it is stored, not a save point.

Storing a sandbox on a server with a remote store pushes its state there (tiers.py), so that it
wakes even where the local store lost its chunks. Once the sandbox runs again (its restored VM
answered and the registry says it runs) or has ended, that copy is no one's state any more: it has
no tag, nothing lists it, and left alone it would stay in the store for good. So it goes, as the
local copy does, by the store's mark and sweep (``forkd_engine.store.delete``: its manifest, then
the chunks no other manifest lists and older than the grace period; younger ones a later delete
sweeps). A save point that lasts is a branch, pushed under a tag (``forkd push``).

The delete is off the wake's path (it reads every manifest in the store), one at a time on a thread
of its own. It is recorded first, as a file ``forgetting/<hex>`` in the data dir, before the record
that the sandbox left the stored tier, and a restart finishes what is recorded. A state a stored
sandbox still names (a wake cut short before its record) is never deleted; a copy in a store this
server no longer uses stays there, and the start-up says so with how to delete it. A delete the
store refuses is logged naming the store, and tried again when the server starts again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading

from forkd_engine.store import NotInStore, StoreError, delete as delete_remote, parse_digest

log = logging.getLogger("forkd.store")


class StoredCopies:
    def __init__(self, stores):
        self.stores = stores  # the StoreManager: its remote store and grace period
        self.registry = stores.registry
        self._dir = os.path.join(stores.ctl.data_dir, "forgetting")
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending: set[str] = set()
        self._closing = threading.Event()
        self._worker = threading.Thread(target=self._work, name="forkd-stored-copies", daemon=True)
        self._worker.start()

    def leaving(self, sandbox_id: str, stored: dict | None) -> str | None:
        """Record that the sandbox's stored state leaves the remote store; call it before the record
        that the sandbox is no longer stored, and ``delete_later`` with what it returns after it.
        None when there is no remote copy (or the record could not be written: then it is said)."""
        if not stored or not stored.get("remote"):
            return None
        key = parse_digest(stored["digest"])
        path = os.path.join(self._dir, key)
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"digest": stored["digest"], "store": stored.get("store"), "sandbox": sandbox_id}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
        except OSError as exc:
            log.warning("forkd: the stored state %s of sandbox %s stays in %s: recording its delete failed (%s); "
                        "delete it with DELETE /v1/store/snapshots/%s", stored["digest"], sandbox_id,
                        stored.get("store"), exc, stored["digest"])
            return None
        return key

    def delete_later(self, key: str | None) -> None:
        if key is None:
            return
        with self._idle:
            if key in self._pending:
                return
            self._pending.add(key)
        self._queue.put(key)

    def resume(self) -> list[str]:
        """At start-up: delete the copies recorded and not deleted yet; one line for each that stays."""
        found = []
        for key in sorted(os.listdir(self._dir)):
            if key.endswith(".tmp"):  # its record was never complete: the sandbox is still stored
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self._dir, key))
                continue
            line = self._unreachable(key)
            if line:
                found.append(line)
            else:
                self.delete_later(key)
        return found

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no delete is queued or under way; True if so within ``timeout``."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self, wait: float) -> None:
        """Stop the worker and wait for a delete under way (``wait`` s at most); the queued ones stay
        recorded, for the next start (``resume``)."""
        self._closing.set()
        self._queue.put(None)
        self._worker.join(wait)

    # --- the worker --------------------------------------------------------------------------------

    def _record(self, key: str) -> dict | None:
        try:
            with open(os.path.join(self._dir, key)) as f:
                record = json.load(f)
            return record if isinstance(record, dict) and record.get("digest") else None
        except (OSError, ValueError):
            return None

    def _done(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self._dir, key))

    def _unreachable(self, key: str) -> str | None:
        """Why this server cannot delete the copy ``key`` records (its record then goes), else None."""
        record = self._record(key)
        if record is None:
            self._done(key)
            return None
        remote = self.stores.remote
        if remote is not None and remote.url == record.get("store"):
            return None
        self._done(key)
        return (f"the stored state {record['digest']} of sandbox {record.get('sandbox')} (woken or ended) stays in "
                f"{record.get('store')}: this server " + ("has no remote store" if remote is None else
                                                          f"uses another store ({remote.url})") +
                f"; delete it from a server of that store: DELETE /v1/store/snapshots/{record['digest']}")

    def _work(self) -> None:
        while (key := self._queue.get()) is not None:
            try:
                if not self._closing.is_set():  # else left recorded, for the next start
                    self._delete(key)
            except Exception:  # noqa: BLE001 - its record stays: the next start-up tries again
                log.exception("forkd: deleting a woken sandbox's stored state %s failed", key)
            finally:
                with self._idle:
                    self._pending.discard(key)
                    self._idle.notify_all()

    def _delete(self, key: str) -> None:
        line = self._unreachable(key)
        if line:
            log.warning("forkd: %s", line)
            return
        record = self._record(key)
        if record is None:
            return
        digest = record["digest"]
        if any((r.get("stored") or {}).get("digest") == digest for r in self.registry.list_sandboxes()):
            self._done(key)  # a sandbox is stored in it still: it is its state, not a leftover
            return
        remote = self.stores.remote
        try:
            figures = delete_remote(remote, digest, grace_seconds=self.stores.grace_seconds)
        except NotInStore:  # gone already (its manifest, or one the sweep read): nothing of it is left to do
            figures = {}
        except StoreError as exc:
            log.warning("forkd: the stored state %s of sandbox %s stays in %s for now: %s; the server tries again "
                        "when it starts again", digest, record.get("sandbox"), remote.url, exc)
            return
        self._done(key)
        log.info("forkd: deleted the stored state %s of sandbox %s from %s (%d chunks removed)", digest,
                 record.get("sandbox"), remote.url, figures.get("removed_chunks", 0))
