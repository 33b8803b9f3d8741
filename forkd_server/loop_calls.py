"""Agent calls answered on the server's event loop: a ping, an eval and an exec of a running sandbox.

A ping is mostly the hop: a control thread taken and handed back (admission.py) costs the server
more CPU than the agent's answer, and under many calls at once the threads contend for the GIL.
So a ping of a running sandbox is answered on the loop: its row read, its call counted (so no move
down happens under it, tiers.py) and the agent asked on the connection kept to it (agent/kept.py),
all without waiting for another thread. Whatever would wait (a commit holding the registry, a move
holding the sandbox's lock, another thread checking liveness, a full listen queue at the agent) or
is not the plain case (a sandbox unknown, ending, frozen, stored or dead) goes the usual way, on
the control pool, which waits, wakes and says why. A failed exchange is explained on the pool too
(``SandboxManager.agent_failed``: 410 if the sandbox ended during it). The answers and errors are
the control pool's.

An eval or an exec is the same hop with user code at the other end (an agent's most frequent
calls): once admitted (the server's and the caller's caps, the sandbox's lane: admission.py), it too
is made on the loop when nothing would wait, on a second connection kept to the agent, so the pings
behind a long one are not held up; otherwise it runs on the long pool as before. The lane sends one
at a time per sandbox, so that connection never queues one call behind another. (A cell, ``run``,
stays on the pool: its timeout interrupts it there.)
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter

from forkd_engine import EngineError
from forkd_engine.agent.server import encode_line

from .controller.sandboxes import EVAL_TIMEOUT, eval_answer, exec_answer, exec_request, exec_timeout
from .errors import BadRequest

PING = encode_line({"action": "ping"})  # the request, encoded once


class FailedOnLoop(Exception):
    """An agent call made on the loop failed: ``LoopCalls.explain`` says how it is answered."""

    def __init__(self, row: dict, failure: Exception, what: str):
        super().__init__(f"{what}: {failure}")
        self.row, self.failure, self.what = row, failure, what


class LoopCalls:
    def __init__(self, admission, registry: CollectorRegistry | None = None):
        self.admission = admission
        self.ways = Counter("forkd_loop_calls", "Agent calls (ping, eval, exec) by where they were answered: on the "
                            "event loop, or on a pool's thread because the loop would have waited",
                            ["call", "way"], registry=registry if registry is not None else CollectorRegistry())
        self._ways = {(call, way): self.ways.labels(call=call, way=way)
                      for call in ("ping", "eval", "exec") for way in ("loop", "pool")}

    async def ping(self, controller, sandbox_id: str, timeout: float = 5.0) -> dict:
        """``controller.ping(sandbox_id)``'s answer, on the loop where nothing waits."""
        try:
            reply = await self.ping_now(controller, sandbox_id, timeout)
        except FailedOnLoop as failed:
            return await self.explain(controller, failed)
        if reply is None:
            self._ways["ping", "pool"].inc()
            return await self.admission.control(functools.partial(controller.ping, sandbox_id, timeout))
        return reply

    async def ping_now(self, controller, sandbox_id: str, timeout: float = 5.0) -> dict | None:
        """A running sandbox's ping answered on the loop, or None where ``ping`` would go the usual
        way. A failed exchange raises ``FailedOnLoop``, which ``explain`` answers (plain_ping.py)."""
        reply = await self._on_loop_or_none(controller, sandbox_id, PING, "ping", timeout)
        if reply is not None:
            self._ways["ping", "loop"].inc()
        return reply

    async def explain(self, controller, failed: FailedOnLoop) -> dict:
        """Raise what the call answers for ``failed``: 410 if the sandbox ended during it, else 500
        saying what failed (``SandboxManager.agent_failed``, on the control pool)."""
        return await self.admission.control(functools.partial(controller.sandboxes.agent_failed, dict(failed.row),
                                                               failed.failure, failed.what))

    async def eval(self, controller, sandbox_id: str, code: str, *, caller: str) -> dict:
        """``controller.eval(sandbox_id, code)``'s answer, admitted as a long call of ``caller`` in
        the sandbox's lane, then made on the loop where nothing waits, else on a long call's thread."""
        def request():
            return ({"action": "eval", "code": code}, EVAL_TIMEOUT) if isinstance(code, str) else None

        return await self._long(controller, sandbox_id, "eval", functools.partial(controller.eval, sandbox_id, code),
                                request, eval_answer, caller)

    async def exec(self, controller, sandbox_id: str, args, timeout_secs=30, env=None, cwd=None, *,
                   caller: str) -> dict:
        """``controller.exec(...)``'s answer, as ``eval``'s."""
        def request():
            try:
                made = exec_request(args, timeout_secs, env, cwd)
            except BadRequest:
                return None
            return made, exec_timeout(made)

        return await self._long(controller, sandbox_id, "exec",
                                functools.partial(controller.exec, sandbox_id, args, timeout_secs, env=env, cwd=cwd),
                                request, exec_answer, caller)

    async def _long(self, controller, sandbox_id: str, call: str, fn, request, answer, caller: str) -> dict:
        """``fn`` as ``Admission.long`` runs it, with the loop's way in: ``request()`` is the agent's
        request and its timeout, or None where ``fn`` says what is wrong; ``answer`` shapes the reply."""
        async def on_loop() -> dict | None:
            made = request()
            try:
                reply = None if made is None else await self._on_loop_or_none(
                    controller, sandbox_id, encode_line(made[0]), call, made[1], long=True)
            except FailedOnLoop as failed:
                return await self.explain(controller, failed)
            self._ways[call, "pool" if reply is None else "loop"].inc()
            return None if reply is None else answer(reply)

        return await self.admission.long(fn, caller=caller, what=f"an {call}", sandbox=sandbox_id, lane=True,
                                         on_loop=on_loop)

    async def _on_loop_or_none(self, controller, sandbox_id: str, request: bytes, what: str,
                               timeout: float, long: bool = False) -> dict | None:
        """The agent's answer to ``request`` (its line), or None: the call must go the usual way.
        ``long``: on the agent connection kept for long calls (``ProcessEngine.call_async``). A failed
        exchange raises ``FailedOnLoop`` (``explain`` answers it)."""
        try:
            row = controller.tiers.enter_now(sandbox_id)
        except BlockingIOError:
            return None
        if row is None:
            return None
        try:
            call_async = getattr(controller.engines[row["engine"]], "call_async", None)
            if call_async is None:  # an engine without one (the VM engine's channel)
                return None
            try:
                return await call_async(row["handle"], request, timeout=timeout, long=long)
            except BlockingIOError:
                return None
            except EngineError as exc:
                failure = exc
        finally:
            controller.tiers.leave(row["id"])
        raise FailedOnLoop(row, failure, what)
