"""The per-caller cap under ``forkd serve``, where every client has the same token: each SDK client
(its ``X-Forkd-Client`` id) has a cap of its own, so one client holding its cap starves no other."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import pytest

from forkd_server.client import Controller, ControllerError

from ..serving import serving


@pytest.fixture(scope="module")
def server():
    with serving("--ForkdApp.max_long_calls_per_caller=2") as srv:
        yield srv


def long_calls_running(server) -> float:
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {server.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("forkd_long_calls_running "):
                return float(line.split()[1])
    raise AssertionError("no forkd_long_calls_running in /metrics")


def until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


WAIT_FOR_GO = ["sh", "-c", "while [ ! -e /tmp/go ]; do sleep 0.05; done; echo went"]


def test_one_client_at_its_cap_leaves_the_others_theirs(server):
    greedy, other = Controller(server.url, server.token), Controller(server.url, server.token)
    assert greedy.client_id != other.client_id
    greedy.create_snapshot("cap", setup="x = 1")
    a, b, c = (s["id"] for s in greedy.spawn_sandboxes("cap", 3))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(greedy.exec_command, sb, WAIT_FOR_GO, timeout_secs=120) for sb in (a, b)]
        try:
            until(lambda: long_calls_running(server) == 2, "the greedy client's two calls to run")
            with pytest.raises(ControllerError) as info:  # its own third call: its cap
                greedy.eval_code(c, "x")
            assert info.value.status == 429 and "max_long_calls_per_caller" in str(info.value)
            assert other.eval_code(c, "x + 1")["result"] == "2"  # same token, another client: admitted
            headerless = urllib.request.Request(f"{server.url}/v1/sandboxes/{c}/eval", data=b'{"code": "x"}',
                                                headers={"Authorization": f"Bearer {server.token}",
                                                         "Content-Type": "application/json"})
            with urllib.request.urlopen(headerless, timeout=30) as r:  # no client id: the token's own count
                assert r.status == 200
        finally:
            for sb in (a, b):
                other.write_file(sb, "/tmp/go", "")
            results = [h.result(timeout=60) for h in held]
    assert [r["stdout"] for r in results] == ["went\n", "went\n"]
