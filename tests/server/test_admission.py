"""The admission policy on its own (forkd_server/controller/admission.py): caps, the per-sandbox lane, kills.

Calls here block on events the test sets, so each state (running, waiting, refused) is reached by
a readiness check, never by a sleep.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import CollectorRegistry

from forkd_server.controller.admission import Admission
from forkd_server.errors import Busy, Conflict, Gone, TooManyRequests


class Blocker:
    """A blocking call that runs until released (or fails, as a killed sandbox's call does)."""

    def __init__(self):
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail: Exception | None = None

    def __call__(self):
        self.started.set()
        self.release.wait(30)
        if self.fail is not None:
            raise self.fail
        return "done"


async def until(predicate, what: str, limit: int = 2000):
    for _ in range(limit):  # bounded: each state is reached within a few loop turns
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never reached: {what}")


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels or None)


@pytest.fixture
def admission():
    registry = CollectorRegistry()
    adm = Admission(max_long_calls=3, max_long_calls_per_caller=2, control_workers=2, sandbox_queue_size=1,
                    sandbox_queue_timeout=30, registry=registry)
    adm.registry = registry
    yield adm
    adm.close()


async def test_server_and_caller_caps(admission):
    a, b, c = Blocker(), Blocker(), Blocker()
    t1 = asyncio.ensure_future(admission.long(a, caller="x", what="an exec", sandbox="s1", lane=True))
    t2 = asyncio.ensure_future(admission.long(b, caller="x", what="an exec", sandbox="s2", lane=True))
    await until(lambda: a.started.is_set() and b.started.is_set(), "two calls running")
    with pytest.raises(TooManyRequests, match="(?s)you have 2 long calls in progress.*max_long_calls_per_caller"):
        await admission.long(Blocker(), caller="x", what="a spawn")
    t3 = asyncio.ensure_future(admission.long(c, caller="y", what="a spawn"))
    await until(c.started.is_set, "another caller's call running")
    with pytest.raises(Busy, match="(?s)3 long calls .* in progress, the most this server admits\n.*max_long_calls"):
        await admission.long(Blocker(), caller="z", what="a spawn")
    # control calls do not wait for any of them
    assert await admission.control(lambda: "pong") == "pong"
    r = admission.registry
    assert value(r, "forkd_long_calls_running") == 3
    assert value(r, "forkd_calls_refused_total", reason="caller_cap") == 1
    assert value(r, "forkd_calls_refused_total", reason="server_cap") == 1
    assert value(r, "forkd_long_calls_cap") == 3 and value(r, "forkd_long_calls_per_caller_cap") == 2
    for blocker in (a, b, c):
        blocker.release.set()
    assert await asyncio.gather(t1, t2, t3) == ["done"] * 3
    assert admission.admitted == 0 and not admission.callers and not admission.lanes


async def test_one_call_per_sandbox_then_in_order_then_busy(admission):
    first, second = Blocker(), Blocker()
    t1 = asyncio.ensure_future(admission.long(first, caller="x", what="an eval", sandbox="s", lane=True))
    await until(first.started.is_set, "the first call running")
    t2 = asyncio.ensure_future(admission.long(second, caller="y", what="an eval", sandbox="s", lane=True))
    await until(lambda: len(admission.lanes["s"].waiting) == 1, "the second call waiting")
    assert not second.started.is_set()  # one call per sandbox: it waits, holding no thread
    assert value(admission.registry, "forkd_long_calls_waiting") == 1
    with pytest.raises(Conflict) as info:  # the queue (size 1) is full
        await admission.long(Blocker(), caller="z", what="an exec", sandbox="s", lane=True)
    message = str(info.value)
    assert "sandbox s is busy: it runs an eval" in message and "1 more calls already wait" in message
    assert info.value.hint == "wait for it, interrupt it or kill it"
    assert info.value.details["interrupt"] == "POST /v1/sandboxes/s/interrupt"
    assert info.value.details["kill"].startswith("DELETE /v1/sandboxes/s ")
    # outside the lane (files, branch) and other sandboxes are not held up
    other = Blocker()
    other.release.set()
    assert await admission.long(other, caller="z", what="a file read", sandbox="s") == "done"
    first.release.set()
    assert await t1 == "done"
    await until(second.started.is_set, "the second call's turn")
    second.release.set()
    assert await t2 == "done"
    assert not admission.lanes


async def test_the_queue_wait_is_bounded():
    adm = Admission(max_long_calls=4, max_long_calls_per_caller=4, sandbox_queue_size=2, sandbox_queue_timeout=0.2)
    try:
        running = Blocker()
        t1 = asyncio.ensure_future(adm.long(running, caller="x", what="a run", sandbox="s", lane=True))
        await until(running.started.is_set, "a call running")
        with pytest.raises(Conflict, match=r"sandbox s is busy: it runs a run .* this call waited 0.2 s"):
            await adm.long(Blocker(), caller="x", what="an eval", sandbox="s", lane=True)
        assert not adm.lanes["s"].waiting
        running.release.set()
        assert await t1 == "done"
    finally:
        adm.close()


async def test_a_kill_ends_the_running_and_the_waiting_calls(admission):
    """An eval queued behind a looping one never waits forever: the kill answers both 410."""
    loop_call, queued = Blocker(), Blocker()
    t1 = asyncio.ensure_future(admission.long(loop_call, caller="x", what="an eval", sandbox="s", lane=True))
    await until(loop_call.started.is_set, "the loop running")
    t2 = asyncio.ensure_future(admission.long(queued, caller="x", what="an eval", sandbox="s", lane=True))
    await until(lambda: admission.lanes["s"].waiting, "an eval waiting")
    done = admission.ending("s", "DELETE /v1/sandboxes/s")
    with pytest.raises(Gone, match="sandbox s was killed while this call waited for its turn"):
        await t2
    assert not queued.started.is_set()
    loop_call.fail = ConnectionResetError("agent closed the connection")  # what the kill does to it
    loop_call.release.set()
    with pytest.raises(Gone, match=r"sandbox s was killed during this call \(an eval\)"):
        await t1
    done(True)
    assert value(admission.registry, "forkd_calls_ended_by_kill_total") == 2
    assert admission.admitted == 0 and not admission.lanes


async def test_a_failed_kill_leaves_the_lane_open(admission):
    running = Blocker()
    t1 = asyncio.ensure_future(admission.long(running, caller="x", what="an exec", sandbox="s", lane=True))
    await until(running.started.is_set, "a call running")
    admission.ending("s", "DELETE")(False)
    running.fail = RuntimeError("its own failure")
    running.release.set()
    with pytest.raises(RuntimeError, match="its own failure"):  # not blamed on a kill that did not happen
        await t1


async def test_a_client_that_goes_away_passes_its_turn_on(admission):
    first, third = Blocker(), Blocker()
    t1 = asyncio.ensure_future(admission.long(first, caller="x", what="an eval", sandbox="s", lane=True))
    await until(first.started.is_set, "the first call running")
    t2 = asyncio.ensure_future(admission.long(Blocker(), caller="x", what="an eval", sandbox="s", lane=True))
    await until(lambda: admission.lanes["s"].waiting, "a call waiting")
    t2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t2
    assert not admission.lanes["s"].waiting and admission.admitted == 1
    first.release.set()
    await t1
    third.release.set()
    assert await admission.long(third, caller="x", what="an eval", sandbox="s", lane=True) == "done"


async def test_an_answer_that_comes_after_the_kill_began_is_410(admission):
    """An exec whose process the kill ended answers normally (exit -9); the caller learns the truth."""
    running = Blocker()
    t1 = asyncio.ensure_future(admission.long(running, caller="x", what="an exec", sandbox="s", lane=True))
    await until(running.started.is_set, "a call running")
    done = admission.ending("s", "DELETE /v1/sandboxes/s")
    running.release.set()  # returns "done", but after the kill began
    with pytest.raises(Gone, match=r"sandbox s was killed during this call \(an exec\)"):
        await t1
    done(True)
    assert not admission.lanes
