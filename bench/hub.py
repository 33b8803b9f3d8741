"""What forkd as a JupyterHub service adds to a call: the Hub's answer for a token (cached by
``HubAuth``) and the ownership filter, on a real Hub (tests/hub/hubrun.py) with forkd as its service.

Method. forkd on its own port (no proxy hop), one keep-alive connection per caller. Each round times
``GET /v1/sandboxes`` once with the operator's ``--token-file`` token (no Hub, sees all) and once
with alice's Hub token (a cached Hub answer, her sandboxes only), in alternating order, so a busy
machine's load falls on both alike; reported: each one's p50 and p99 and the median of the paired
differences. Also: the first call with a fresh token (the Hub asked once, then cached), median of
``--fresh`` tokens. Sandboxes: ``--sandboxes`` of alice's and as many of bob's.

Usage: python3 bench/hub.py [--json] [--rounds 1000] [--sandboxes 20] [--fresh 20]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import Controller  # noqa: E402
from tests.hub.hubrun import Hub  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def timed(conn: http.client.HTTPConnection, path: str, token: str) -> float:
    t0 = time.perf_counter()
    conn.request("GET", path, headers={"Authorization": f"token {token}"})
    response = conn.getresponse()
    response.read()
    assert response.status == 200, response.status
    return (time.perf_counter() - t0) * 1000


def run(rounds: int, sandboxes: int, fresh: int) -> dict:
    hub = Hub()
    try:
        hub.wait_ready()
        hub.api("POST", "/users", {"usernames": ["alice", "bob"]})
        tokens = {name: hub.user_token(name) for name in ("alice", "bob", "boss")}
        Controller(hub.forkd_url, tokens["boss"]).create_snapshot("bench-base", setup="x = 1")
        Controller(hub.forkd_url, tokens["boss"]).share_snapshot("bench-base")
        for name in ("alice", "bob"):
            Controller(hub.forkd_url, tokens[name]).spawn_sandboxes("bench-base", sandboxes)
        path = "/services/forkd/v1/sandboxes"
        port = hub.ports["forkd_port"]
        callers = {"operator": hub.operator_token, "hub_user": tokens["alice"]}
        conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=30) for name in callers}
        times: dict[str, list[float]] = {name: [] for name in callers}
        for name in callers:  # warm: connections open, alice's token in HubAuth's cache
            timed(conns[name], path, callers[name])
        for i in range(rounds):
            order = list(callers) if i % 2 == 0 else list(reversed(callers))
            for name in order:
                times[name].append(timed(conns[name], path, callers[name]))
        first = []
        for _ in range(fresh):
            token = hub.user_token("alice")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            timed(conn, "/services/forkd/version", hub.operator_token)  # the connection, not the token
            first.append(timed(conn, path, token))
            conn.close()
        diffs = [h - o for h, o in zip(times["hub_user"], times["operator"])]
        return {
            "rounds": rounds, "sandboxes_each": sandboxes,
            **{f"{name}_p50_ms": round(statistics.median(v), 3) for name, v in times.items()},
            **{f"{name}_p99_ms": round(quantile(v, 0.99), 3) for name, v in times.items()},
            "hub_minus_operator_median_ms": round(statistics.median(diffs), 3),
            "fresh_token_first_call_p50_ms": round(statistics.median(first), 3),
        }
    finally:
        hub.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--fresh", type=int, default=20)
    args = parser.parse_args()
    result = run(args.rounds, args.sandboxes, args.fresh)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36} {value}")


if __name__ == "__main__":
    main()
