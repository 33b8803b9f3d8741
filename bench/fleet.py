"""What ``forkd router`` adds: the same calls through the router and to the host directly, same run.

Two ``forkd serve`` hosts (process engine) and a ``forkd router`` in front of them, all
subprocesses on loopback, as users run them (tests/fleet/fleet.py). A process snapshot ``base`` is
made on host 0, so every call below lands there either way.

* ``ping``: ``POST /v1/sandboxes/{id}/ping`` of one sandbox on a kept-alive connection
  (http.client), router vs direct, the two interleaved in each round so the machine's load falls on
  both alike. Reported: each p50 and the median of the paired differences (router minus direct).
* ``spawn(n=20)``: ``POST /v1/sandboxes {"n": 20}`` then the 20 killed, router vs direct,
  alternating rounds; the ratio of the medians (router / direct) and each median. The router's
  share is placement (every up host's snapshot listing, in parallel) plus passing the call on.

Usage: python3 bench/fleet.py [--json] [--pings 500] [--spawns 15]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import Controller  # noqa: E402
from tests.fleet.fleet import fleet  # noqa: E402


class Conn:
    """One kept-alive connection to ``url`` with a token."""

    def __init__(self, url: str, token: str):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def call(self, method: str, path: str, body=None):
        self.conn.request(method, path, body=None if body is None else json.dumps(body), headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status >= 400:
            raise RuntimeError(f"{method} {path}: {resp.status} {data[:200]!r}")
        return json.loads(data) if data else None


def ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pings", type=int, default=500)
    ap.add_argument("--spawns", type=int, default=15)
    args = ap.parse_args()
    with fleet(2, router_args=("--heartbeat", "2")) as (router, hosts):
        Controller(hosts[0].url, hosts[0].token, timeout=300).create_snapshot("base", setup="x = 1")
        via, direct = Conn(router.url, router.token), Conn(hosts[0].url, hosts[0].token)
        sid = via.call("POST", "/v1/sandboxes", {"snapshot_tag": "base"})[0]["id"]
        ping = f"/v1/sandboxes/{sid}/ping"
        for _ in range(50):  # warm both paths (connections, the router's pin lookup)
            via.call("POST", ping)
            direct.call("POST", ping)
        r_s, d_s, diffs = [], [], []
        for i in range(args.pings):
            order = (via, direct) if i % 2 else (direct, via)
            took = {}
            for conn in order:
                t0 = time.perf_counter()
                conn.call("POST", ping)
                took[conn] = time.perf_counter() - t0
            r_s.append(took[via])
            d_s.append(took[direct])
            diffs.append(took[via] - took[direct])
        via.call("DELETE", f"/v1/sandboxes/{sid}")

        def spawn(conn: Conn) -> float:
            t0 = time.perf_counter()
            kids = conn.call("POST", "/v1/sandboxes", {"snapshot_tag": "base", "n": 20})
            took = time.perf_counter() - t0
            assert len(kids) == 20
            for k in kids:
                direct.call("DELETE", f"/v1/sandboxes/{k['id']}")
            return took

        spawn(via), spawn(direct)  # warm-up
        sr, sd = [], []
        for i in range(args.spawns):
            for conn in ((via, direct) if i % 2 else (direct, via)):
                (sr if conn is via else sd).append(spawn(conn))
    figures = {
        "ping": {"router_p50_ms": ms(r_s), "direct_p50_ms": ms(d_s), "overhead_p50_ms": ms(diffs),
                 "n": args.pings, "target_overhead_ms": 2.0},
        "spawn20": {"router_median_ms": ms(sr), "direct_median_ms": ms(sd),
                    "ratio": round(statistics.median(sr) / statistics.median(sd), 3), "n": args.spawns,
                    "target_ratio": 1.10},
        "load": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(figures))
    else:
        p, s = figures["ping"], figures["spawn20"]
        print(f"ping: router p50 {p['router_p50_ms']} ms, direct p50 {p['direct_p50_ms']} ms, "
              f"overhead (median of paired differences) {p['overhead_p50_ms']} ms (target <= 2 ms)")
        print(f"spawn(n=20): router {s['router_median_ms']} ms, direct {s['direct_median_ms']} ms, "
              f"ratio {s['ratio']} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
