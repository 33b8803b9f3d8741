"""Streaming sessions with sandboxes' agents, for the forkd kernel and streamed cells.

A session is the agent's line-JSON conversation (``forkd_engine/agent/session.py``): execute,
complete, inspect, comms, input replies and interrupts in; output events out, as they happen. The
manager opens them through the engine, caps how many are open, and closes them all at shutdown;
each is read on a thread of its own (never the controller's pool, so a long cell holds no slot that
control routes need). The WebSocket handler (``session_handler.py``) carries them to clients.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from forkd_engine import AgentUnreachable, EngineError

from ..errors import Busy, EngineFailure


class SessionManager:
    def __init__(self, controller, max_sessions: int = 256, start_timeout: float = 120.0):
        self.controller = controller
        self.max_sessions = max_sessions
        self.start_timeout = start_timeout  # starting IPython in a sandbox that has none takes a while
        self._open: set = set()
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._open)

    def open(self, sandbox_id: str, *, shell: str = "plain") -> tuple[object, dict]:
        """Open a session with a running sandbox; returns (session, its hello: shell, counters...)."""
        with self._lock:
            if len(self._open) >= self.max_sessions:
                raise Busy(f"{self.max_sessions} sessions are open, the most this server allows",
                           hint="close one (or raise ForkdApp.max_sessions)")
        engine, handle = self.controller.sandbox_engine(sandbox_id)
        try:
            session = engine.open_session(handle, shell=shell)
            hello = session.recv(self.start_timeout)
        except (AgentUnreachable, EngineError, TimeoutError, OSError) as exc:
            raise EngineFailure(f"session with {sandbox_id}: {exc}") from exc
        if hello is None or (hello.get("content") or {}).get("status") != "ok":
            session.close()
            detail = (hello or {}).get("content") or {}
            raise EngineFailure(f"session with {sandbox_id} did not start: "
                                f"{detail.get('ename', 'the agent closed it')}: {detail.get('evalue', '')}")
        with self._lock:
            self._open.add(session)
        return session, hello["content"]

    def pump(self, session, deliver: Callable[[dict | None], None], name: str) -> threading.Thread:
        """Read ``session``'s events on a thread of its own and hand each to ``deliver``; None last."""
        def run() -> None:
            try:
                while True:
                    try:
                        event = session.recv()
                    except (OSError, ValueError, TimeoutError):
                        event = None
                    deliver(event)
                    if event is None:
                        return
            finally:
                self.close(session)

        thread = threading.Thread(target=run, name=f"forkd-session-{name}", daemon=True)
        thread.start()
        return thread

    def writer(self, session, name: str, on_error: Callable[[Exception], None]) -> Callable[[dict], None]:
        """A non-blocking ``send`` for the server's event loop: messages go out on a thread of their
        own, in order, so an agent that stops reading (frozen, paused) never stalls the server."""
        outbox: queue.Queue = queue.Queue()

        def run() -> None:
            while True:
                message = outbox.get()
                if message is None:
                    return
                try:
                    session.send(message)
                except (OSError, ValueError) as exc:
                    on_error(exc)
                    return

        threading.Thread(target=run, name=f"forkd-session-out-{name}", daemon=True).start()
        session.outbox = outbox
        return outbox.put

    def close(self, session) -> None:
        with self._lock:
            self._open.discard(session)
        outbox = getattr(session, "outbox", None)
        if outbox is not None:
            outbox.put(None)
        try:
            session.close()
        except OSError:
            pass

    def close_all(self) -> None:
        for session in list(self._open):
            self.close(session)
