"""What forkd as a JupyterHub service adds to a call: the Hub's answer for a token (cached by
``HubAuth``) and the ownership filter, on a real Hub (tests/hub/hubrun.py) with forkd as its service.

Method. forkd on its own port (no proxy hop), one keep-alive connection per caller. Each round times
``GET /v1/sandboxes`` once with the operator's ``--token-file`` token (no Hub, sees all) and once
with alice's Hub token (a cached Hub answer, her sandboxes only), in alternating order, so a busy
machine's load falls on both alike; reported: each one's p50 and p99 and the median of the paired
differences. Also: the first call with a fresh token (the Hub asked once, then cached), median of
``--fresh`` tokens. Sandboxes: ``--sandboxes`` of alice's and as many of bob's.

``--router``: the Hub's service is ``forkd router --hub`` in front of two ``forkd serve`` hosts
(tests/fleet/fleet.py) instead of one ``forkd serve --hub``; besides the list, each round also times
``POST /v1/sandboxes/{id}/ping`` of one of alice's sandboxes both ways, where alice's call costs the
router a read of the sandbox's labels from its host before it passes the ping on. ``--spawns K``
(with ``--router``): K rounds of ``spawn(n=20)`` of the shared snapshot and the 20 killed, alice and
the operator alternating; each median and the median of the paired differences (alice's spawn also
has the router read the hosts' snapshot listings to check she may use the snapshot).

Usage: python3 bench/hub.py [--json] [--rounds 1000] [--sandboxes 20] [--fresh 20] [--router [--spawns 10]]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import Controller  # noqa: E402
from tests.fleet.fleet import fleet  # noqa: E402
from tests.hub.hubrun import ROUTER_SECTION, Hub  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def timed(conn: http.client.HTTPConnection, path: str, token: str, method: str = "GET") -> float:
    t0 = time.perf_counter()
    conn.request(method, path, headers={"Authorization": f"token {token}"})
    response = conn.getresponse()
    response.read()
    assert response.status == 200, response.status
    return (time.perf_counter() - t0) * 1000


def run(rounds: int, sandboxes: int, fresh: int, router: bool = False, spawns: int = 0) -> dict:
    with started_hub(router) as hub:
        result = measure(hub, rounds, sandboxes, fresh, router)
        if spawns:
            result.update(measure_spawns(hub, spawns))
        return result


def measure_spawns(hub: Hub, rounds: int) -> dict:
    callers = {"operator": Controller(hub.forkd_url, hub.operator_token, timeout=300),
               "hub_user": Controller(hub.forkd_url, hub.tokens["alice"], timeout=300)}
    times: dict[str, list[float]] = {name: [] for name in callers}
    for i in range(rounds):
        for name in list(callers) if i % 2 == 0 else list(reversed(callers)):
            t0 = time.perf_counter()
            kids = callers[name].spawn_sandboxes("bench-base", 20)
            times[name].append((time.perf_counter() - t0) * 1000)
            for kid in kids:
                callers[name].kill_sandbox(kid["id"])
    return {**{f"spawn20_{name}_p50_ms": round(statistics.median(v), 1) for name, v in times.items()},
            "spawn20_hub_minus_operator_median_ms": round(statistics.median(
                [h - o for h, o in zip(times["hub_user"], times["operator"])]), 1)}


@contextlib.contextmanager
def started_hub(router: bool):
    """A Hub whose service is forkd serve, or (``router``) forkd router over two hosts."""
    with contextlib.ExitStack() as stack:
        if router:
            workdir, hosts = stack.enter_context(fleet(2, router=False))
            hub = Hub(["router", "--hub", "--hosts", ",".join(h.url for h in hosts), "--hosts-token-file",
                       os.path.join(workdir, "token"), "--data-dir", os.path.join(workdir, "r")],
                      heading=ROUTER_SECTION)
        else:
            hub = Hub()
        try:
            hub.wait_ready()
            yield hub
        finally:
            hub.stop()


def measure(hub: Hub, rounds: int, sandboxes: int, fresh: int, router: bool) -> dict:
    hub.api("POST", "/users", {"usernames": ["alice", "bob"]})
    tokens = hub.tokens = {name: hub.user_token(name) for name in ("alice", "bob", "boss")}
    Controller(hub.forkd_url, tokens["boss"]).create_snapshot("bench-base", setup="x = 1")
    Controller(hub.forkd_url, tokens["boss"]).share_snapshot("bench-base")
    for name in ("alice", "bob"):
        kids = Controller(hub.forkd_url, tokens[name]).spawn_sandboxes("bench-base", sandboxes)
        if name == "alice":
            ping = f"/services/forkd/v1/sandboxes/{kids[0]['id']}/ping"
    path = "/services/forkd/v1/sandboxes"
    port = hub.ports["forkd_port"]
    callers = {"operator": hub.operator_token, "hub_user": tokens["alice"]}
    conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=30) for name in callers}
    times: dict[str, list[float]] = {name: [] for name in callers}
    pings: dict[str, list[float]] = {name: [] for name in callers}
    for name in callers:  # warm: connections open, alice's token in HubAuth's cache
        timed(conns[name], path, callers[name])
    for i in range(rounds):
        order = list(callers) if i % 2 == 0 else list(reversed(callers))
        for name in order:
            times[name].append(timed(conns[name], path, callers[name]))
            if router:
                pings[name].append(timed(conns[name], ping, callers[name], "POST"))
    first = []
    for _ in range(fresh):
        token = hub.user_token("alice")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        timed(conn, "/services/forkd/version", hub.operator_token)  # the connection, not the token
        first.append(timed(conn, path, token))
        conn.close()
    diffs = [h - o for h, o in zip(times["hub_user"], times["operator"])]
    ping_figures = {} if not router else {
        **{f"ping_{name}_p50_ms": round(statistics.median(v), 3) for name, v in pings.items()},
        "ping_hub_minus_operator_median_ms": round(statistics.median(
            [h - o for h, o in zip(pings["hub_user"], pings["operator"])]), 3)}
    return {
        "service": "forkd router --hub (2 hosts)" if router else "forkd serve --hub",
        "rounds": rounds, "sandboxes_each": sandboxes, **ping_figures,
        **{f"{name}_p50_ms": round(statistics.median(v), 3) for name, v in times.items()},
        **{f"{name}_p99_ms": round(quantile(v, 0.99), 3) for name, v in times.items()},
        "hub_minus_operator_median_ms": round(statistics.median(diffs), 3),
        "fresh_token_first_call_p50_ms": round(statistics.median(first), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--fresh", type=int, default=20)
    parser.add_argument("--router", action="store_true", help="the fleet's router as the service, over two hosts")
    parser.add_argument("--spawns", type=int, default=0, help="with --router: rounds of spawn(n=20) both ways")
    args = parser.parse_args()
    result = run(args.rounds, args.sandboxes, args.fresh, args.router, args.spawns)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36} {value}")


if __name__ == "__main__":
    main()
