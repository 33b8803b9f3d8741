"""The guest agent's runtime and wire protocol, in this process (no namespaces involved)."""

from __future__ import annotations

import base64
import os
import socket
import threading
import time

import pytest

from forkd_engine.agent.client import AgentClient
from forkd_engine.agent.runtime import Runtime
from forkd_engine.agent.server import AgentServer


@pytest.fixture
def rt(tmp_path):
    r = Runtime({"id": "sb-test", "lineage": ["snap", "sb-test"]})
    r.cwd = str(tmp_path)
    return r


def test_eval_namespace_persists_across_calls(rt):
    assert rt.handle({"action": "eval", "code": "(x := 20) + 1"}) == {"result": "21", "exit_code": 0}
    assert rt.handle({"action": "eval", "code": "x * 2"})["result"] == "40"


def test_eval_error_is_forkd_shaped(rt):
    reply = rt.handle({"action": "eval", "code": "1/0"})
    assert reply["exit_code"] == 1
    assert reply["error"] == "ZeroDivisionError: division by zero"
    assert "Traceback" in reply["traceback"]


def test_run_code_statements_stdout_and_last_value(rt):
    reply = rt.handle({"action": "run_code", "code": "y = 3\nprint('hello')\ny * 7"})
    assert reply["exit_code"] == 0
    assert reply["stdout"] == "hello\n"
    assert reply["result"]["text/plain"] == "21"
    assert rt.handle({"action": "eval", "code": "y"})["result"] == "3"  # same namespace as eval


def test_run_code_rich_outputs(rt):
    code = ("class H:\n    def _repr_html_(self): return '<b>hi</b>'\n"
            "display(H())\nH()")
    reply = rt.handle({"action": "run_code", "code": code})
    kinds = [o["type"] for o in reply["outputs"]]
    assert kinds == ["display_data", "execute_result"]
    assert reply["outputs"][0]["data"]["text/html"] == "<b>hi</b>"
    assert reply["result"]["text/html"] == "<b>hi</b>"


def test_run_code_error_keeps_only_user_frames(rt):
    reply = rt.handle({"action": "run_code", "code": "def f():\n    raise ValueError('bad')\nf()"})
    assert reply["exit_code"] == 1
    assert reply["error"]["ename"] == "ValueError"
    assert reply["error"]["evalue"] == "bad"
    assert all("runtime.py" not in line for line in reply["error"]["traceback"])
    assert any("<cell>" in line for line in reply["error"]["traceback"])


def test_run_code_system_exit_does_not_end_agent(rt):
    reply = rt.handle({"action": "run_code", "code": "raise SystemExit(3)"})
    assert reply["error"]["ename"] == "SystemExit"
    assert rt.handle({"action": "ping"})["pong"] is True


def test_exec_captures_and_reports_exit_code(rt):
    reply = rt.handle({"action": "exec", "args": ["sh", "-c", "echo out; echo err >&2; exit 3"]})
    assert reply == {"stdout": "out\n", "stderr": "err\n", "exit_code": 3}


def test_exec_timeout_kills_the_whole_process_group(rt, tmp_path):
    marker = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    reply = rt.handle({"action": "exec", "timeout": 1,
                       "args": ["sh", "-c", f"sleep 60 & echo $! > {marker}; wait"]})
    assert time.monotonic() - t0 < 10
    assert reply["timed_out"] is True and reply["error"].startswith("TimeoutExpired")
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the SIGKILLed grandchild may linger briefly as a zombie
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    break
        except FileNotFoundError:
            break
    else:
        pytest.fail("the background grandchild survived the timeout")


def test_exec_rejects_bad_args(rt):
    assert rt.handle({"action": "exec", "args": []})["exit_code"] == 1
    assert "error" in rt.handle({"action": "exec", "args": "ls"})


def test_files_roundtrip_list_remove(rt):
    data = os.urandom(5000)
    rt.handle({"action": "files", "op": "write", "path": "d/a.bin", "data_b64": base64.b64encode(data).decode()})
    got = rt.handle({"action": "files", "op": "read", "path": "d/a.bin"})
    assert base64.b64decode(got["data_b64"]) == data and got["size"] == 5000
    part = rt.handle({"action": "files", "op": "read", "path": "d/a.bin", "max_bytes": 10})
    assert part["truncated"] is True and len(base64.b64decode(part["data_b64"])) == 10
    listing = rt.handle({"action": "files", "op": "list", "path": "d"})
    assert [(e["name"], e["type"], e["size"]) for e in listing["entries"]] == [("a.bin", "file", 5000)]
    refused = rt.handle({"action": "files", "op": "remove", "path": "d"})
    assert "recursive" in refused["error"]
    assert rt.handle({"action": "files", "op": "remove", "path": "d", "recursive": True})["removed"]
    assert "FileNotFoundError" in rt.handle({"action": "files", "op": "read", "path": "d/a.bin"})["error"]


def test_unknown_action(rt):
    assert rt.handle({"action": "nope"}) == {"error": "unknown action: nope", "exit_code": 1}


@pytest.fixture
def served(rt, short_dir):
    path = os.path.join(short_dir, "a.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    threading.Thread(target=AgentServer(rt, listener).serve_forever, daemon=True).start()
    return path


def test_forkd_wire_protocol_byte_for_byte(served):
    """forkd's clients send one line, half-close, read to EOF."""
    for request in (b'{"action": "ping"}\n', b'{"action": "exec", "args": ["echo", "hi"], "timeout": 30}\n',
                    b'{"action": "eval", "code": "1+1"}\n'):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(served)
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    client = AgentClient(served)
    assert client.call({"action": "ping"})["pong"] is True
    assert client.call({"action": "exec", "args": ["echo", "hi"], "timeout": 30})["stdout"] == "hi\n"
    assert client.call({"action": "eval", "code": "1+1"}) == {"result": "2", "exit_code": 0}


def test_many_requests_on_one_connection_and_bad_json(served):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(served)
        f = s.makefile("rwb")
        for i in range(3):
            f.write(b'{"action": "eval", "code": "%d*2"}\n' % i)
            f.flush()
            assert f.readline() == b'{"result":"%d","exit_code":0}\n' % (i * 2)
        f.write(b"not json\n")
        f.flush()
        assert b"JSONDecodeError" in f.readline()


def test_ping_answers_while_run_code_is_busy(served, tmp_path):
    client = AgentClient(served)
    release = tmp_path / "release"
    cell = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.01)"
    busy = threading.Thread(target=client.call, args=({"action": "run_code", "code": cell},))
    busy.start()
    try:
        assert client.call({"action": "ping"}, timeout=30)["pong"] is True
        assert busy.is_alive()  # answered while the cell still runs: it only ends once released
    finally:
        release.touch()
        busy.join()


def test_a_waiting_ping_is_answered_on_the_accepting_thread_and_the_rest_on_a_thread(rt, short_dir):
    """A ping already there when its connection is accepted is answered by the accepting thread
    (no thread started for it); what the connection asks next is served on a thread of its own, in
    order; a connection that has sent nothing yet holds up nobody."""
    path = os.path.join(short_dir, "p.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    answered_by = []
    ping = rt.ping
    rt.ping = lambda request: (answered_by.append(threading.current_thread().name), ping(request))[1]
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(path)  # accepted first, says nothing yet
    alone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    alone.connect(path)
    alone.sendall(b'{"action": "ping"}\n')
    alone.shutdown(socket.SHUT_WR)  # as forkd's clients do
    asks_on = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    asks_on.connect(path)
    asks_on.sendall(b'{"action": "ping"}\n{"action": "eval", "code": "6*7"}\n')
    threading.Thread(target=AgentServer(rt, listener).serve_forever, name="accepting", daemon=True).start()
    with alone, asks_on, silent:
        alone.settimeout(30)
        assert b'"pong":true' in alone.recv(65536) and alone.recv(1) == b""  # answered, then closed
        f = asks_on.makefile("rwb")
        asks_on.settimeout(30)
        assert b'"pong":true' in f.readline()
        assert f.readline() == b'{"result":"42","exit_code":0}\n'
        assert answered_by == ["accepting", "accepting"]
        f.write(b'{"action": "ping"}\n')  # later on the same connection: its thread answers
        f.flush()
        assert b'"pong":true' in f.readline()
        assert answered_by[2] == "forkd-conn"
        silent.settimeout(30)
        silent.sendall(b'{"action": "ping"}\n')
        assert b'"pong":true' in silent.makefile("rb").readline()
