"""64 stuck long calls against a real ``forkd serve``: control routes still answer, and a kill
frees the calls stuck in (and queued for) the sandbox it kills.

Before admission.py every call shared one pool of 64 threads, so 64 evals of ``time.sleep(1e6)``
left list, ping, spawn and DELETE waiting for a thread (the audit measured over 60 s). Every
request here carries a client timeout far above any answer the server should need: it bounds a
hang, it measures nothing.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from ..serving import serving

STUCK = 64
HANG = 120  # seconds: only a hung server takes this long


def request(url: str, token: str, method: str, path: str, body=None, timeout: float = HANG):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw and r.headers.get_content_type() == "application/json" else raw)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def metrics(url: str, token: str) -> dict[str, float]:
    _, text = request(url, token, "GET", "/metrics")
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.decode().splitlines()
                                     if line and not line.startswith("#"))}


@pytest.fixture(scope="module")
def server():
    # room for the 64 stuck evals, the two queued behind one and a spawn, all from one caller; two
    # may wait per sandbox, until the kill
    with serving("--ForkdApp.max_long_calls_per_caller=80", "--ForkdApp.sandbox_queue_size=2",
                 "--ForkdApp.sandbox_queue_timeout=600") as srv:
        yield srv


def test_control_answers_while_64_long_calls_are_stuck(server):
    url, token = server.url, server.token
    assert request(url, token, "POST", "/v1/snapshots", {"tag": "stuck"})[0] == 201
    code, kids = request(url, token, "POST", "/v1/sandboxes", {"snapshot_tag": "stuck", "n": STUCK + 1})
    assert code == 201
    stuck, spare = [k["id"] for k in kids[:STUCK]], kids[STUCK]["id"]
    loop = {"code": "__import__('time').sleep(1e6)"}
    with ThreadPoolExecutor(STUCK + 4) as pool:
        try:
            evals = {sid: pool.submit(request, url, token, "POST", f"/v1/sandboxes/{sid}/eval", loop, 600)
                     for sid in stuck}
            deadline = time.monotonic() + HANG
            while metrics(url, token).get("forkd_long_calls_running") != STUCK:  # readiness: all on their threads
                assert time.monotonic() < deadline, metrics(url, token)
                time.sleep(0.05)
            queued = [pool.submit(request, url, token, "POST", f"/v1/sandboxes/{stuck[0]}/eval", {"code": "1 + 1"}, 600)
                      for _ in range(2)]
            while metrics(url, token).get("forkd_long_calls_waiting") != 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)

            # every stuck sandbox really runs the sleep (one request pings all of them). A call on its
            # server thread may not have reached its agent's main thread yet on a loaded host, and a
            # ping the loaded host answers late says "not answering" (true, yet no proof): poll
            # until each says what it runs.
            expected = {**{sid: "an eval" for sid in stuck}, spare: None}
            while True:
                code, nodes = request(url, token, "GET", "/v1/tree?busy=true")
                assert code == 200
                busy = {n["id"]: n.get("busy") for n in nodes if n["kind"] == "sandbox"}
                if busy == expected or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert busy == expected, busy

            # control routes answer; so does a spawn (a long call of its own, with a free slot)
            code, listed = request(url, token, "GET", "/v1/sandboxes")
            assert code == 200 and len(listed) == STUCK + 1
            assert request(url, token, "POST", f"/v1/sandboxes/{spare}/ping")[1]["pong"] is True
            assert request(url, token, "POST", f"/v1/sandboxes/{stuck[1]}/ping")[1]["pong"] is True
            assert request(url, token, "GET", f"/v1/sandboxes/{stuck[1]}")[0] == 200
            code, extra = request(url, token, "POST", "/v1/sandboxes", {"snapshot_tag": "stuck"})
            assert code == 201
            assert request(url, token, "DELETE", f"/v1/sandboxes/{extra[0]['id']}")[0] == 204

            # a third call for the same sandbox: refused at once (its queue is full), saying what to do
            code, body = request(url, token, "POST", f"/v1/sandboxes/{stuck[0]}/exec", {"args": ["true"]})
            assert code == 409 and "is busy: it runs an eval" in body["error"] and "interrupt" in body["error"]

            # DELETE frees the stuck call and the ones queued behind it: each answers 410, none hangs
            assert request(url, token, "DELETE", f"/v1/sandboxes/{stuck[0]}")[0] == 204
            answers = [evals[stuck[0]].result(HANG)] + [q.result(HANG) for q in queued]
            assert [code for code, _ in answers] == [410, 410, 410], answers
            assert "was killed during this call (an eval)" in answers[0][1]["error"]
            assert all("was killed while this call waited for its turn" in body["error"] for _, body in answers[1:])

            for sid in stuck[1:]:
                assert request(url, token, "DELETE", f"/v1/sandboxes/{sid}")[0] == 204
            assert {evals[sid].result(HANG)[0] for sid in stuck[1:]} == {410}
        except BaseException:  # free the stuck calls, or leaving the pool waits on them for good
            for kid in kids:
                request(url, token, "DELETE", f"/v1/sandboxes/{kid['id']}")
            raise

    figures = metrics(url, token)
    assert figures["forkd_long_calls_running"] == 0 and figures["forkd_long_calls_waiting"] == 0
    assert figures["forkd_calls_ended_by_kill_total"] == STUCK + 2
    assert figures['forkd_calls_refused_total{reason="sandbox_busy"}'] == 1
    assert request(url, token, "GET", "/v1/sandboxes")[1] == [{**kids[STUCK], "branch_count": 0}] or \
        [s["id"] for s in request(url, token, "GET", "/v1/sandboxes")[1]] == [spare]
