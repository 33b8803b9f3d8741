"""HEAD: the sandbox a forkd notebook runs its cells in, and the session the kernel keeps with it.

One streaming session (``forkd_server.streaming.Session``, shell ``ipython``) is open to HEAD; a
reader thread hands each event to the request that waits for it (by ``id``), or to ``on_other``
for what comes between requests (a widget's update from a thread, output of a background thread).
Moving HEAD closes the old session and opens one to the new sandbox; the session of a sandbox that
died ends with ``ended`` saying so, and nothing is ever silently restarted in its place.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from forkd_server.streaming import Session, SessionClosed

__all__ = ["Head", "HeadGone"]


class HeadGone(RuntimeError):
    """The sandbox this notebook runs in is gone; its state with it. Says how to go on: ``what``
    happened, ``hint`` what to do, ``details`` the rest (the kernel shows them collapsed)."""

    def __init__(self, what: str, hint: str = "", details: dict | None = None):
        super().__init__(f"{what}\n{hint}" if hint else what)
        self.what, self.hint, self.details = what, hint, dict(details or {})


class Head:
    def __init__(self, controller, on_other: Callable[[dict], None]):
        self.controller = controller
        self.on_other = on_other
        self.sandbox_id: str | None = None
        self.snapshot_tag: str | None = None  # the snapshot HEAD was forked from
        self.session: Session | None = None
        self.hello: dict = {}
        self.ended: str | None = None  # why HEAD's session ended (the sandbox died), else None
        self.end_said: tuple[str, dict] = ("", {})  # the server's hint and details about that end
        self.comms: set[str] = set()   # comm ids the sandbox opened (closed on the frontend at checkout)
        self.parked = False            # HEAD was stored on purpose (idle.py): its session's end is no death
        self.before_request: Callable[[], object] = lambda: None  # wakes HEAD first (idle.py)
        self._waiting: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    # --- moving ----------------------------------------------------------------------------------

    def attach(self, sandbox_id: str, snapshot_tag: str | None = None) -> dict:
        """Make ``sandbox_id`` (forked from ``snapshot_tag``) HEAD: open its IPython session;
        returns the session's hello."""
        session = self.controller.session(sandbox_id, shell="ipython")
        old = self.session
        with self._lock:
            if sandbox_id != self.sandbox_id:
                self.snapshot_tag = snapshot_tag
            self.session, self.sandbox_id, self.hello, self.ended = session, sandbox_id, session.hello, None
            self.end_said = ("", {})
            self.comms = set()
        threading.Thread(target=self._read, args=(session,), name=f"forkd-head-{sandbox_id}", daemon=True).start()
        if old is not None:
            old.close()
        return session.hello

    def close(self) -> None:
        if self.session is not None:
            self.session.close()

    # --- talking ---------------------------------------------------------------------------------

    def reconnect(self) -> bool:
        """After the session ended: if the server still has HEAD (it only restarted), open a new
        session to it, state intact; False when HEAD is really gone."""
        if self.ended is None or self.sandbox_id is None:
            return False
        try:
            self.controller.get_sandbox(self.sandbox_id)
            self.attach(self.sandbox_id)
        except Exception:  # noqa: BLE001 - still unreachable, or gone: check() says which
            self.ended = self._why_ended()
            return False
        return True

    def check(self) -> Session:
        """HEAD's session, or ``HeadGone`` that names the sandbox and the ways on."""
        if self.session is None:
            raise HeadGone("this notebook has no sandbox yet",
                           "the forkd kernel is still starting, or could not start: see the kernel's first message")
        if self.ended is not None and self.ended.startswith("unreachable"):
            raise HeadGone(f"the forkd server at {self.controller.base_url} does not answer, so this notebook's "
                           f"sandbox {self.sandbox_id} cannot be reached",
                           "sandboxes outlive their server: start it again and run the cell again, the state is "
                           "still there", {"why": self.ended})
        if self.ended is not None:
            raise self.gone()
        return self.session

    def gone(self, why: str | None = None, said: tuple[str, dict] | None = None) -> HeadGone:
        """HEAD is gone: which sandbox and ``why`` (the server's reason), then the ways on from there,
        the branches taken of it first (the snapshots that hold its state as it was), and ``said``,
        the server's hint and details about the end."""
        hint, details = said if said is not None else self.end_said
        if details.get("limit") in ("memory", "huge_pages"):
            details = {**details, "notebook": "the notebook's sandboxes take their memory limit from "
                                              "$FORKD_KERNEL_MEMORY_LIMIT_MIB (or ForkdKernel.memory_limit_mib; "
                                              "unset: all of the host's memory): where it is set lower, raise "
                                              "it and restart the kernel"}
        why = why or self.ended or "killed or exited: the server no longer has it"
        ways, more = self._ways_on()
        return HeadGone(f"this notebook's sandbox {self.sandbox_id} is gone, and its variables with it: {why}",
                        f"nothing was restarted in its place: {ways}; a kernel restart starts a fresh one",
                        {**more, **({"server_hint": hint} if hint else {}), **details})

    def _ways_on(self) -> tuple[str, dict]:
        """How to go on from a HEAD that is gone, and the details that go with it."""
        anything = "%forkd checkout TAG|SB continues from a snapshot or sandbox (%forkd ls lists them)"
        try:
            snapshots = self.controller.list_snapshots()
            # the tree's times are exact; a listing's whole seconds would tie a branch and a fork
            made = {n["id"]: n.get("created_at") or 0 for n in self.controller.tree() if n.get("kind") == "snapshot"}
        except Exception:  # noqa: BLE001 - the server is not answering: say the general way
            return anything, {}
        # its branches (a fork's snapshot among them), newest first
        branches = sorted((s for s in snapshots if s.get("branched_from") == self.sandbox_id),
                          key=lambda s: (made.get(s["tag"]) or s.get("created_at_unix", 0), s["tag"]), reverse=True)
        ready = [s["tag"] for s in branches if s.get("status") == "ready"]
        failed = [s["tag"] for s in branches if s.get("status") == "failed"]
        more = {k: ", ".join(v) for k, v in (("branches", ready), ("branches that failed with it", failed)) if v}
        if ready:
            return (f"%forkd checkout {ready[0]} continues from the latest branch taken of it (%forkd ls lists "
                    f"the others)"), {**more, "branches": more["branches"] + " (newest first)"}
        if not failed and any(s["tag"] == self.snapshot_tag and s.get("status") == "ready" for s in snapshots):
            return (f"%forkd checkout {self.snapshot_tag} starts again from the snapshot it was forked from (no "
                    f"branch was taken of it)"), more
        return anything, more

    def open_request(self, kind: str, **fields) -> tuple[str, queue.SimpleQueue]:
        """Send a request; its events and its reply arrive on the returned queue (None: session ended).
        A ``SimpleQueue``: the kernel's SIGINT handler puts on it (kernel.sigint_handled_by)."""
        self.before_request()
        session = self.check()
        rid = session.new_id()
        events: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:  # the reader marks the end under this lock: we see it, or it sees us
            ended = self.ended is not None or session is not self.session
            if not ended:
                self._waiting[rid] = events
        if ended:
            self.check()  # raises, saying why
            raise HeadGone(f"the session with {self.sandbox_id} ended")
        try:
            session.send({"type": kind, "id": rid, **fields})
        except SessionClosed:
            self.finish(rid)
            raise HeadGone(f"the session with {self.sandbox_id} closed while sending the request") from None
        return rid, events

    def finish(self, rid: str) -> None:
        with self._lock:
            self._waiting.pop(rid, None)

    def request(self, kind: str, timeout: float = 30.0, **fields) -> dict:
        """A request whose events are not needed (complete, inspect...): its reply's content."""
        rid, events = self.open_request(kind, **fields)
        try:
            while True:
                event = events.get(timeout=timeout)
                if event is None:
                    self.check()
                    raise HeadGone(f"the session with {self.sandbox_id} ended")
                if event.get("type") == f"{kind}_reply":
                    return event.get("content") or {}
        finally:
            self.finish(rid)

    def send(self, message: dict) -> None:
        self.before_request()
        try:
            self.check().send(message)
        except SessionClosed:
            raise HeadGone(f"the session with {self.sandbox_id} is closed") from None

    # --- the reader ------------------------------------------------------------------------------

    def _read(self, session: Session) -> None:
        while True:
            event = session.recv()
            if event is None:
                if self.parked and session is self.session:  # stored on purpose: woken by the next request
                    with self._lock:
                        self.ended = "stored: its state is in the store, the next request wakes it"
                        waiting = list(self._waiting.values())
                    for events in waiting:
                        events.put(None)
                    return
                why = self._why_ended() if session is self.session else None
                with self._lock:
                    current = session is self.session
                    if current:
                        self.ended = why or "its session closed"
                    waiting = list(self._waiting.values()) if current else []
                for events in waiting:
                    events.put(None)
                return
            if event.get("type") == "comm_open":
                self.comms.add((event.get("content") or {}).get("comm_id"))
            elif event.get("type") == "comm_close":
                self.comms.discard((event.get("content") or {}).get("comm_id"))
            with self._lock:
                events = self._waiting.get(event.get("id"))
            if events is not None:
                events.put(event)
            elif session is self.session:
                self.on_other(event)

    def _why_ended(self) -> str:
        # A ping, not a GET: right after the session broke the sandbox may still be exiting, and
        # the server's ping waits for that before it answers why it ended (410, or 404 once gone).
        try:
            self.controller.ping_sandbox(self.sandbox_id)
        except Exception as exc:  # noqa: BLE001 - any failure to reach it is the answer
            status = getattr(exc, "status", None)
            if status is None:
                return f"unreachable: {exc}"
            if status not in (404, 410):
                return f"its session closed, though the server still lists it ({exc})"
            # The server says when and why it ended (a limit it died of, a kill), when it knows.
            ended = (exc.body.get("ended") if isinstance(getattr(exc, "body", None), dict) else None) or {}
            self.end_said = (getattr(exc, "hint", ""), getattr(exc, "details", {}))
            return str(ended.get("reason") or "killed or exited: the server no longer has it")
        return "its session closed, though the server still lists it"
