"""What /healthz's capacity block costs: ``GET /healthz`` (capacity figures read on the health
thread) against ``GET /version`` (answered on the event loop, nothing read), on one ``forkd serve``
holding ``--sandboxes`` real sandboxes (process engine) and one ready snapshot.

Method. One keep-alive connection (http.client), as a router's heartbeat keeps one per host. Each
round times both routes once, in alternating order, so a busy machine's load falls on both alike;
reported: each route's p50 and p99, and the median of the paired differences (healthz minus
version), which is what the capacity block (its reads and the hop to the health thread) adds to
a health check.

Usage: python3 bench/healthz.py [--json] [--rounds 2000] [--sandboxes 100]
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
from tests.serving import serving  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(rounds: int, sandboxes: int) -> dict:
    with serving() as srv:
        ctl = Controller(srv.url, srv.token)
        ctl.create_snapshot("hz", setup="x = 1")
        ctl.spawn_sandboxes("hz", sandboxes)
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        auth = {"Authorization": f"Bearer {srv.token}"}

        def timed(path: str) -> float:
            t0 = time.perf_counter()
            conn.request("GET", path, headers=auth)
            r = conn.getresponse()
            body = r.read()
            elapsed = time.perf_counter() - t0
            assert r.status == 200, (path, r.status, body)
            return elapsed

        for _ in range(50):  # warm up both routes and the connection
            timed("/healthz")
            timed("/version")
        health, version = [], []
        for i in range(rounds):
            order = ("/healthz", "/version") if i % 2 == 0 else ("/version", "/healthz")
            got = {path: timed(path) for path in order}
            health.append(got["/healthz"])
            version.append(got["/version"])
        conn.request("GET", "/healthz")
        block = json.loads(conn.getresponse().read())["capacity"]
        conn.close()
    ms = 1e3
    return {
        "rounds": rounds, "sandboxes": sandboxes, "capacity": block,
        "healthz_p50_ms": round(statistics.median(health) * ms, 3),
        "healthz_p99_ms": round(quantile(health, 0.99) * ms, 3),
        "version_p50_ms": round(statistics.median(version) * ms, 3),
        "version_p99_ms": round(quantile(version, 0.99) * ms, 3),
        "added_p50_ms": round(statistics.median(h - v for h, v in zip(health, version)) * ms, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--sandboxes", type=int, default=100)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = run(args.rounds, args.sandboxes)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"/healthz with {out['sandboxes']} sandboxes: p50 {out['healthz_p50_ms']} ms, p99 {out['healthz_p99_ms']} ms")
        print(f"/version (event loop only): p50 {out['version_p50_ms']} ms, p99 {out['version_p99_ms']} ms")
        print(f"the capacity block adds (median of paired differences): {out['added_p50_ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
