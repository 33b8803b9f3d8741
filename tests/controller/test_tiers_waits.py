"""A call that meets a wake under way waits for it, bounded, then answers 503 saying what holds the
sandbox (never a 500); once the wake is done, calls go through. The wake is held with an event
(the engine's thaw blocks on it), so nothing here depends on timing."""

from __future__ import annotations

import threading

import pytest

from forkd_server.controller import tiers
from forkd_server.errors import Busy


@pytest.fixture
def frozen(ctl):
    ctl.create_snapshot("tw", setup="x = 41")
    sb = ctl.spawn("tw")[0]["id"]
    ctl.freeze_sandbox(sb)
    yield sb
    ctl.kill_sandbox(sb)
    ctl.delete_snapshot("tw")


def test_a_call_during_a_wake_waits_then_gets_a_503_saying_why(ctl, frozen, monkeypatch):
    engine = ctl.engines["process"]
    release, thawing = threading.Event(), threading.Event()
    real_thaw = engine.thaw

    def held_thaw(handle):
        thawing.set()
        release.wait(60)
        real_thaw(handle)

    monkeypatch.setattr(engine, "thaw", held_thaw)
    monkeypatch.setattr(tiers, "WAKE_WAIT", 0.5)
    first = {}
    waker = threading.Thread(target=lambda: first.update(reply=ctl.eval(frozen, "x + 1")))
    waker.start()
    assert thawing.wait(30)
    with pytest.raises(Busy) as err:  # the wake holds it past WAKE_WAIT
        ctl.eval(frozen, "x")
    assert err.value.status == 503 and "busy with a wake" in err.value.what and "retry" in err.value.hint
    release.set()
    waker.join(60)
    assert first["reply"]["result"] == "42"
    assert ctl.eval(frozen, "x")["result"] == "41" and ctl.get_sandbox(frozen)["tier"] == "running"
