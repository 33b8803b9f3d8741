"""A streaming session: line-JSON both ways between a client (the forkd kernel, a streamed
``run_code``) and a sandbox's agent, independent of the transport that carries the lines.

In: ``execute``, ``complete``, ``inspect``, ``is_complete``, ``history``, ``comm_info``,
``comm_open``/``comm_msg``/``comm_close``, ``input_reply``, ``interrupt``. Each carries an ``id``.
Out: ``stream``, ``display_data``, ``update_display_data``, ``clear_output``, ``execute_result``,
``error``, ``comm_open``/``comm_msg``/``comm_close``, ``input_request``, ``status``, and one
``<type>_reply`` per request with its ``content``. Events carry the ``id`` of the request they
belong to (None for what happens between requests, e.g. a widget's background update).

Requests run one at a time on the sandbox's main thread (``Executor``); ``input_reply`` and
``interrupt`` are handled at once on the reading thread, so they reach a cell that is running.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Callable

from .executor import Busy, Executor

QUEUED = ("execute", "complete", "inspect", "is_complete", "history", "comm_info",
          "comm_open", "comm_msg", "comm_close")



def error_content(exc: BaseException) -> dict:
    """The content of the error reply to a request that raised ``exc`` (no traceback: not user code)."""
    return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc), "traceback": []}

class SessionClosed(EOFError):
    """The client went away while the cell waited for it (e.g. for an input reply)."""


class Session:
    def __init__(self, runtime, send: Callable[[dict], None]):
        self.runtime = runtime
        self._send = send
        self._send_lock = threading.Lock()
        self.inputs: queue.Queue = queue.Queue()
        self.current: str | None = None  # id of the request the main thread is running for us
        self.closed = False
        self._private: Executor | None = None  # where there is no main-thread executor (tests)

    # --- out -------------------------------------------------------------------------------------

    def emit(self, event: dict, request_id: str | None = None) -> None:
        if self.closed:
            return
        event = dict(event)
        event.setdefault("id", request_id if request_id is not None else self.current)
        try:
            with self._send_lock:
                self._send(event)
        except OSError:
            self.close()

    def reply(self, kind: str, request_id: str | None, content: dict) -> None:
        self.emit({"type": f"{kind}_reply", "content": content}, request_id)

    # --- in --------------------------------------------------------------------------------------

    def handle(self, msg: dict) -> None:
        """One message from the client (called on the reading thread)."""
        kind = msg.get("type") if isinstance(msg, dict) else None
        rid = msg.get("id") if isinstance(msg, dict) else None
        if kind == "input_reply":
            self.inputs.put(str(msg.get("value", "")))
        elif kind == "interrupt":
            executor = self.runtime.executor or self._private
            interrupted = executor.interrupt() if executor is not None else False
            self.reply("interrupt", rid, {"status": "ok", "interrupted": interrupted})
        elif kind in QUEUED:
            try:
                self._executor().submit(lambda: self._answered(kind, msg), f"a session {kind}",
                                        user_code=(kind == "execute" or kind.startswith("comm_")),
                                        then=lambda answer: answer is not None and self.reply(*answer))
            except Busy as exc:
                self.reply(kind, rid, error_content(exc))
        else:
            self.reply(str(kind), rid, {"status": "error", "ename": "ValueError", "traceback": [],
                                        "evalue": f"unknown session message type {kind!r}; use one of "
                                                  f"{', '.join(QUEUED + ('input_reply', 'interrupt'))}"})

    def _executor(self) -> Executor:
        if self.runtime.executor is not None:
            return self.runtime.executor
        if self._private is None:  # no main-thread executor here: one thread of our own, in order
            self._private = Executor(max_queued=64)
            threading.Thread(target=self._private.run_forever, name="forkd-session-exec", daemon=True).start()
        return self._private

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.inputs.put(None)  # a cell waiting for input ends with EOFError
        if self._private is not None:
            self._private.jobs.put(None)
        detach = getattr(self.runtime.runner, "detach", None)
        if detach is not None:
            detach(self)

    # --- on the main thread ----------------------------------------------------------------------

    def _answered(self, kind: str, msg: dict) -> tuple | None:
        """``_run``, with an error reply for whatever it raises (an interrupt too, even one landing
        after the cell): every request gets its reply."""
        try:
            return self._run(kind, msg)
        except BaseException as exc:  # noqa: BLE001
            return kind, msg.get("id"), error_content(exc)

    def _run(self, kind: str, msg: dict) -> tuple | None:
        """Run one request; returns its reply (kind, id, content), sent once the main thread is
        idle again, or None when there is none."""
        if self.closed:
            return None
        rid = msg.get("id")
        runner = self.runtime.runner
        if kind == "execute":
            content = self._execute(runner, msg)
        elif kind == "complete":
            content = runner.complete_request(msg.get("code", ""), msg.get("cursor_pos"))
        elif kind == "inspect":
            content = runner.inspect(msg.get("code", ""), msg.get("cursor_pos"),
                                     detail_level=msg.get("detail_level", 0),
                                     omit_sections=msg.get("omit_sections", ()))
        elif kind == "is_complete":
            content = runner.is_complete(msg.get("code", ""))
        elif kind == "history":
            content = self._history(msg)
        else:  # comm_info and comm messages: only a shell with comms has them
            handler = getattr(runner, kind, None)
            if handler is None:
                content = {"status": "ok", "comms": {}} if kind == "comm_info" else None
            else:
                self.current = rid
                try:
                    content = handler(msg, self)
                finally:
                    self.current = None
            if content is None:
                return None  # comm_open/msg/close have no reply in Jupyter's protocol
        return kind, rid, content

    def _execute(self, runner, msg: dict) -> dict:
        rid = msg.get("id")
        code = msg.get("code", "")
        silent = bool(msg.get("silent", False))
        store_history = bool(msg.get("store_history", not silent))
        allow_stdin = bool(msg.get("allow_stdin", False))
        self.current = rid
        self.emit({"type": "status", "execution_state": "busy"}, rid)
        result: list = []

        def emit(event: dict) -> None:
            if event.get("type") == "execute_result":
                result.append((event.get("data") or {}).get("text/plain"))
            self.emit(event, rid)

        try:
            content = runner.execute(
                code, emit, silent=silent, store_history=store_history,
                user_expressions=msg.get("user_expressions") or {}, execution_count=msg.get("execution_count"),
                input_fn=(lambda prompt, password: self._input(rid, prompt, password)) if allow_stdin else None,
                session=self)
        finally:
            self.current = None
        if not silent:  # every cell that changed the state is in the log; Jupyter's history only stored ones
            # Numbered only when the client owns the counter (the forkd kernel); a streamed run_code is not
            numbered = msg.get("execution_count") is not None
            self.runtime.history.append({"n": content.get("execution_count") if numbered else None, "code": code,
                                         "output": result[-1] if result else None, "stored": store_history,
                                         "sandbox": self.runtime.identity.get("id"), "time": time.time()})
        self.emit({"type": "status", "execution_state": "idle"}, rid)
        return content

    def _input(self, rid: str | None, prompt: str, password: bool) -> str:
        """Ask the client for a line (the cell's input()/getpass) and wait for its answer."""
        with contextlib.suppress(queue.Empty):  # a stale answer from an earlier, interrupted request
            while True:
                self.inputs.get_nowait()
        self.emit({"type": "input_request", "prompt": prompt, "password": password}, rid)
        value = self.inputs.get()
        if value is None:
            raise SessionClosed("the client went away before answering input()")
        return value

    def _history(self, msg: dict) -> dict:
        entries = self.runtime.history if msg.get("detail") else [e for e in self.runtime.history
                                                                   if e.get("stored", True)]
        access = msg.get("hist_access_type", "tail")
        if access == "search":
            import fnmatch
            pattern = msg.get("pattern") or "*"
            entries = [e for e in entries if fnmatch.fnmatch(e["code"], pattern)]
            if msg.get("unique"):
                seen: set[str] = set()
                entries = [e for e in reversed(entries) if not (e["code"] in seen or seen.add(e["code"]))][::-1]
        if access == "range":
            start, stop = msg.get("start") or 0, msg.get("stop")
            entries = [e for e in entries if (e["n"] or 0) >= start and (stop is None or (e["n"] or 0) < stop)]
        n = msg.get("n")
        if access in ("tail", "search") and n:
            entries = entries[-int(n):]
        # (session, line number, input): one "session" here, the notebook's whole lineage
        if msg.get("output"):
            history = [[0, e["n"], [e["code"], e.get("output")]] for e in entries]
        else:
            history = [[0, e["n"], e["code"]] for e in entries]
        reply = {"status": "ok", "history": history}
        if msg.get("detail"):  # forkd's own use (%forkd log): which sandbox ran each cell, and when
            reply["entries"] = [dict(e) for e in entries]
        return reply
