"""Running cells over a streaming session, written once (sans-I/O): the conversation the forkd
kernel has with its sandbox (messages are JSON objects both ways; see
``forkd_engine/agent/session.py`` for the types). Each function is an operation of ``_core``
effects (``Send``/``Recv`` on a session, ``Emit`` for a caller's loop) that ``Session`` and
``AsyncSession`` run with their drivers."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from ._core import Emit, Recv, Send, consume, notify
from ._errors import SessionClosed

ABANDON_WAIT = 5.0       # s a cell has to stop once its caller gave up and interrupted it
INTERRUPT_GRACE = 2.0    # s a cell past its timeout has to stop once interrupted


def check_hello(sandbox_id: str, hello: dict | None) -> dict:
    """The session's first message must be its ``session_reply``; returns its content."""
    if hello is None or hello.get("type") != "session_reply":
        raise SessionClosed(f"session with {sandbox_id} did not start: {hello!r}")
    return hello.get("content") or {}


def request(session, kind: str, on_event: Callable | None = None, timeout: float | None = None,
            **fields) -> Iterator:
    """Send one request; return its reply's content; events on the way go to ``on_event``."""
    rid = session.new_id()
    yield Send(session, {"type": kind, "id": rid, **fields})
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        event = yield Recv(session, left)
        if event is None:
            raise SessionClosed(f"the session with {session.sandbox_id} ended before its {kind} reply "
                                f"(was the sandbox killed?)")
        if event.get("type") == f"{kind}_reply" and event.get("id") == rid:
            return event.get("content") or {}
        yield from notify(on_event, event)


def stream(session, code: str, timeout: float | None = None, **options) -> Iterator:
    """Run a cell, emitting its events as they come; the last is its ``execute_reply`` (whose
    content is returned). After ``timeout`` the cell is interrupted; if it has not stopped 2 s
    later, ``TimeoutError``. A cell the sandbox has not started by then (its main thread was slow
    to take it, or runs something else) is interrupted as soon as it starts, if that is within
    those 2 s: an interrupt sent earlier finds nothing to stop, and the cell would run its full
    course. If the caller gives up (an exception thrown in: a cancelled task, Ctrl-C, a loop left
    early, a callback that raised), the cell is interrupted too, and its end awaited for a few
    seconds, so the sandbox is free again when the caller goes on."""
    rid = session.new_id()
    yield Send(session, {"type": "execute", "id": rid, "code": code, **options})
    deadline = None if timeout is None else time.monotonic() + timeout
    started = False      # the sandbox said it runs the cell (its busy status): an interrupt reaches it
    overdue = False      # the timeout passed before it started
    interrupted = False
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = yield Recv(session, left)
            except TimeoutError:
                if deadline is None:
                    raise
                if interrupted:
                    raise TimeoutError(f"the cell in {session.sandbox_id} ran past {timeout:g} s and did not stop "
                                       f"when interrupted") from None
                if overdue:
                    raise TimeoutError(f"the cell in {session.sandbox_id} did not start within {timeout:g} s and "
                                       f"{INTERRUPT_GRACE:g} s more (its main thread is busy with something "
                                       f"else, or the host is overloaded)") from None
                overdue, deadline = True, time.monotonic() + INTERRUPT_GRACE
                if started:
                    interrupted = True
                    yield Send(session, {"type": "interrupt", "id": session.new_id()})
                continue
            if event is None:
                raise SessionClosed(f"the session with {session.sandbox_id} ended during the cell")
            if (event.get("type") == "status" and event.get("id") == rid
                    and event.get("execution_state") == "busy" and not started):
                started = True
                if overdue:  # past its timeout already: stopped now that an interrupt reaches it
                    interrupted, deadline = True, time.monotonic() + INTERRUPT_GRACE
                    yield Send(session, {"type": "interrupt", "id": session.new_id()})
            yield Emit(event)
            if event.get("type") == "execute_reply" and event.get("id") == rid:
                return event.get("content") or {}
    except (SessionClosed, TimeoutError):
        raise
    except BaseException:
        yield from _abandon(session, rid)
        raise


def _abandon(session, rid: str) -> Iterator:
    """Interrupt the cell ``rid`` and wait (bounded) for its reply; a closed session ends it too."""
    try:
        yield Send(session, {"type": "interrupt", "id": session.new_id()})
        deadline = time.monotonic() + ABANDON_WAIT
        while (left := deadline - time.monotonic()) > 0:
            event = yield Recv(session, left)
            if event is None or (event.get("type") == "execute_reply" and event.get("id") == rid):
                return
    except (SessionClosed, TimeoutError, OSError):
        return


def execute(session, code: str, *, on_event: Callable | None = None,
            input: Callable[[str, bool], Any] | None = None, timeout: float | None = None,  # noqa: A002
            **options) -> Iterator:
    """Run a cell; its output events go to ``on_event`` as they happen; returns the reply.
    ``input(prompt, password)`` answers the cell's ``input()``."""

    def handle(event: dict) -> Iterator:
        if event.get("type") == "execute_reply":
            return
        if event.get("type") == "input_request" and input is not None:
            value = yield from notify(input, event.get("prompt", ""), bool(event.get("password")))
            yield Send(session, {"type": "input_reply", "value": value})
        else:
            yield from notify(on_event, event)

    return (yield from consume(stream(session, code, timeout, allow_stdin=input is not None, **options), handle))
