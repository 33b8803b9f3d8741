"""Streaming sessions through ``forkd serve`` (WebSocket ``/v1/sandboxes/{id}/session``) with the SDK."""

from __future__ import annotations

import os
import threading

import pytest

from forkd_server.client import Controller, ControllerError, Snapshot
from forkd_server.streaming import Session, SessionClosed

from ..signals import signal_report



@pytest.fixture(scope="module")
def snap(ctl):
    return Snapshot.create("streams", controller=ctl, setup="import os, time\nbase = 41")


def test_output_streams_while_the_cell_runs(ctl, snap):
    # The cell waits for a file the test writes only after it has seen the cell's first line: if
    # output arrived at the end of the cell, this would never finish.
    sb = snap.fork(1)[0]
    seen = []

    def on_event(event):
        seen.append(event)
        if event.get("type") == "stream" and "ready" in event.get("text", ""):
            sb.files.write("/tmp/go", "")

    code = "print('ready', flush=True)\nwhile not os.path.exists('/tmp/go'):\n    time.sleep(0.01)\nprint('done')\nbase + 1"
    execution = sb.run_code(code, timeout=60, on_event=on_event)
    assert execution.stdout == "ready\ndone\n"
    assert execution.text == "42"
    kinds = [e["type"] for e in seen]
    assert kinds.index("stream") < kinds.index("execute_result")


def test_interrupt_stops_the_cell_and_keeps_the_state(ctl, snap):
    sb = snap.fork(1)[0]
    with sb.session() as session:
        assert session.request("execute", code="x = 21")["status"] == "ok"
        started = threading.Event()
        reply: dict = {}
        worker = threading.Thread(target=lambda: reply.update(session.execute(
            "print('sleeping', flush=True)\ntime.sleep(60)", on_event=lambda e: started.set())))
        worker.start()
        assert started.wait(30)
        session.interrupt()
        worker.join(30)
        assert not worker.is_alive(), signal_report(sb.info.get("pid"))
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
        assert session.request("execute", code="x + 1", store_history=False)["status"] == "ok"
    assert sb.eval("x") == "21"


def test_an_interrupt_that_arrives_while_sigint_is_ignored_still_lands(ctl, snap):
    """Code that ignores SIGINT for a moment (a library's critical section) must not swallow the
    user's interrupt: the agent sends it again until the cell takes it."""
    sb = snap.fork(1)[0]
    code = ("import signal\nkept = signal.getsignal(signal.SIGINT)\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('ignoring', flush=True)\n"
            "time.sleep(1)\nsignal.signal(signal.SIGINT, kept)\ntime.sleep(60)")
    with sb.session() as session:
        started = threading.Event()
        reply: dict = {}
        worker = threading.Thread(target=lambda: reply.update(session.execute(
            code, on_event=lambda e: e.get("type") == "stream" and started.set())))
        worker.start()
        assert started.wait(30)
        session.interrupt()  # lands while SIGINT is ignored: the first signal is discarded
        worker.join(30)
        assert not worker.is_alive(), signal_report(sb.info.get("pid"))
        assert reply["ename"] == "KeyboardInterrupt"
    sb.kill()


def test_timeout_interrupts_the_cell(ctl, snap):
    sb = snap.fork(1)[0]
    execution = sb.run_code("time.sleep(60)", timeout=1)
    assert execution.error["ename"] == "KeyboardInterrupt"
    # the user's frames only: the cell stopped at its line, not in the agent's SIGINT handler
    assert execution.error["traceback"] == ["Traceback (most recent call last):\n",
                                            '  File "<cell>", line 1, in <module>\n', "KeyboardInterrupt\n"]
    assert sb.ping()["busy"] is None  # the main thread is free again


def test_a_timeout_before_the_cell_starts_interrupts_no_other_cell(ctl, snap):
    """A cell queued behind another session's cell (a notebook's, say) that is still waiting when
    its timeout passes is not interrupted before it starts: an interrupt then would stop the other
    session's cell. It times out saying it never started, and the other cell runs on."""
    sb = snap.fork(1)[0]
    ready = threading.Event()
    first: dict = {}
    code = "print('ready', flush=True)\nwhile not os.path.exists('/tmp/go'):\n    time.sleep(0.01)\n'finished'"
    holder = threading.Thread(target=lambda: first.update(out=sb.run_code(
        code, timeout=120, on_stdout=lambda text: ready.set())))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(TimeoutError, match=r"did not start within 1 s and 2 s more"):
            sb.run_code("time.sleep(60)", timeout=1)
    finally:
        sb.files.write("/tmp/go", "")
        holder.join(30)
    assert first["out"].error is None and first["out"].text == "'finished'"  # not interrupted
    sb.kill()


def test_input_round_trip(ctl, snap):
    sb = snap.fork(1)[0]
    prompts = []
    with sb.session() as session:
        reply = session.execute("name = input('who? ')", input=lambda prompt, pw: prompts.append(prompt) or "ada")
    assert reply["status"] == "ok" and prompts == ["who? "]
    assert sb.eval("name") == "'ada'"


def test_ipython_shell_is_started_on_request_and_kept_by_forks(ctl, snap):
    sb = snap.fork(1)[0]
    with sb.session(shell="ipython") as session:
        assert session.shell == "ipython"
        events = []
        reply = session.execute("%time y = sum(range(10))\ny", on_event=events.append, execution_count=7)
        assert reply["status"] == "ok" and reply["execution_count"] == 7
        assert any(e["type"] == "execute_result" and e["execution_count"] == 7 for e in events)
        complete = session.request("complete", code="import o", cursor_pos=8)
        assert "os" in complete["matches"]
    kid = sb.branch().fork(1)[0]
    with kid.session() as session:  # the fork has the shell (and its counter) without asking
        assert session.shell == "ipython" and session.hello["execution_count"] == 8


def test_a_killed_sandbox_ends_its_session(ctl, snap):
    sb = snap.fork(1)[0]
    session = sb.session()
    sb.kill()
    with pytest.raises(SessionClosed):
        session.request("execute", code="1", timeout=30)
    session.close()


def test_errors_before_the_upgrade_are_forkd_shaped(server, ctl, snap):
    with pytest.raises(ControllerError) as info:
        Session(ctl, "sb-nope")
    assert info.value.status == 404 and "sb-nope" in info.value.message
    sb = snap.fork(1)[0]
    with pytest.raises(ControllerError) as info:
        Session(Controller(server.url, "wrong-token"), sb.id)
    assert info.value.status == 401 and info.value.message == "invalid bearer token"
    with pytest.raises(ControllerError) as info:
        Session(Controller(server.url, ""), sb.id)
    assert info.value.status == 401 and info.value.message == "missing bearer token"


def test_rest_interrupt(ctl, snap):
    sb = snap.fork(1)[0]
    assert ctl.interrupt(sb.id) == {"interrupted": False, "running": None}
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(ctl.run_code(sb.id, "time.sleep(60)")))
    worker.start()
    while not ctl.ping_sandbox(sb.id)["busy"]:
        pass
    assert ctl.interrupt(sb.id)["interrupted"] is True
    worker.join(30)
    assert result["error"]["ename"] == "KeyboardInterrupt"


def test_stream_code_yields_events_as_they_happen(ctl, snap):
    sb = snap.fork(1)[0]
    kinds, texts = [], []
    for event in sb.stream_code("print('one', flush=True)\nprint('two')\n40 + 2"):
        kinds.append(event["type"])
        texts.append(event.get("text") or (event.get("data") or {}).get("text/plain"))
    assert kinds[-1] == "execute_reply" and "execute_result" in kinds
    assert "".join(t for k, t in zip(kinds, texts) if k == "stream") == "one\ntwo\n" and "42" in texts
