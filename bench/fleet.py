"""What ``forkd router`` adds: the same calls through the router and to the host directly, same run.

Two ``forkd serve`` hosts (process engine) and a ``forkd router`` in front of them, all
subprocesses on loopback, as users run them (tests/fleet/fleet.py). A process snapshot ``base`` is
made on host 0, so every call below lands there either way.

* ``ping``: ``POST /v1/sandboxes/{id}/ping`` of one sandbox on a kept-alive connection
  (http.client), router vs direct, the two interleaved in each round so the machine's load falls on
  both alike. Reported: each p50 and the median of the paired differences (router minus direct).
* ``spawn(n=20)``: ``POST /v1/sandboxes {"n": 20}`` then the 20 killed, router vs direct, both in
  each round in alternating order; each median, their ratio, and the median of the paired
  differences over the direct median (``paired_ratio``: the steadier figure, as a spawn's own time
  varies by 2x with the machine's load). The router's share is placement (every up host's snapshot
  listing, in parallel) plus passing the call on.
* ``--clients N --seconds S``: N clients (one AsyncController each, so N kept connections) ping
  through the router for S seconds, spread over 20 sandboxes on both hosts; errors counted, and
  afterwards every sandbox must still answer through the router at the host it was placed on
  (``lost_pins``: those that do not).

* ``--split R``: spawn(n=40) through a router whose two hosts take 20 each (``--max-sandboxes
  20``, both holding the snapshot), so it is split 20 + 20, against one uncapped host doing all 40
  directly; R rounds, alternating; the ratio of the medians (split / one host). Both hosts share
  this machine's CPUs, so the split can only gain where spawning waits on something else.

Usage: python3 bench/fleet.py [--json] [--pings 500] [--spawns 15] [--clients 200 --seconds 60] [--split 10]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import sys
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import AsyncController, Controller  # noqa: E402
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


def clients_load(router, hosts, clients: int, seconds: float) -> dict:
    """``clients`` clients pinging 20 sandboxes (10 on each host) through the router."""
    api = Controller(router.url, router.token, timeout=300)
    Controller(hosts[1].url, hosts[1].token, timeout=300).create_snapshot("base", setup="x = 1")
    kids = api.spawn_sandboxes("base", 20)  # both hosts hold `base`: placement splits or picks
    placed = {k["id"]: k["host"] for k in kids}
    samples: list[float] = []
    errors: list[str] = []

    async def client(n: int, stop: float) -> None:
        sid = kids[n % len(kids)]["id"]
        async with AsyncController(router.url, router.token, timeout=60) as ctl:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    await ctl.ping_sandbox(sid)
                    samples.append(time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - counted, and the first few shown
                    errors.append(f"{type(exc).__name__}: {exc}")

    async def run() -> None:
        stop = time.monotonic() + seconds
        await asyncio.gather(*(client(n, stop) for n in range(clients)))

    asyncio.run(run())
    lost = [sid for sid, host in placed.items() if api.get_sandbox(sid).get("host") != host]
    for sid in placed:
        api.kill_sandbox(sid)
    ms_sorted = sorted(samples)
    return {"clients": clients, "seconds": seconds, "calls": len(samples), "errors": len(errors),
            "first_errors": errors[:3], "p50_ms": round(statistics.median(ms_sorted) * 1000, 2) if samples else None,
            "p99_ms": round(ms_sorted[int(len(ms_sorted) * 0.99) - 1] * 1000, 2) if samples else None,
            "lost_pins": len(lost), "hosts_used": len(set(placed.values()))}


def split_run(rounds: int) -> dict:
    """spawn(n=40) split over two hosts capped at 20 through the router, against a third, uncapped
    host doing all 40 directly (its snapshot has a tag of its own, so the router never uses it)."""
    caps = [["--ForkdApp.max_sandboxes=20"], ["--ForkdApp.max_sandboxes=20"], []]
    with fleet(3, host_args=caps, router_args=("--heartbeat", "0.5")) as (router, hosts):
        for h in hosts[:2]:
            Controller(h.url, h.token, timeout=300).create_snapshot("split", setup="x = 1")
        Controller(hosts[2].url, hosts[2].token, timeout=300).create_snapshot("alone", setup="x = 1")
        via, alone = Conn(router.url, router.token), Conn(hosts[2].url, hosts[2].token)
        capped = {h.url for h in hosts[:2]}

        def room_again() -> None:  # the router's heartbeat has seen the kills on both capped hosts
            deadline = time.monotonic() + 60
            while any((router.hosts()[u]["capacity"] or {}).get("sandboxes") for u in capped):
                if time.monotonic() > deadline:
                    raise RuntimeError("the router never saw the capped hosts empty again")
                time.sleep(0.05)

        split, single, spread = [], [], []
        for i in range(rounds):
            for which in (("router", "alone") if i % 2 else ("alone", "router")):
                conn, tag = (via, "split") if which == "router" else (alone, "alone")
                t0 = time.perf_counter()
                kids = conn.call("POST", "/v1/sandboxes", {"snapshot_tag": tag, "n": 40})
                (split if which == "router" else single).append(time.perf_counter() - t0)
                if which == "router":
                    spread.append(sorted(sum(k["host"] == u for k in kids) for u in capped))
                for k in kids:
                    conn.call("DELETE", f"/v1/sandboxes/{k['id']}")
                if which == "router":
                    room_again()
    return {"router_split_median_ms": ms(split), "one_host_median_ms": ms(single),
            "ratio": round(statistics.median(split) / statistics.median(single), 3), "split": spread[:3],
            "n": rounds, "target_ratio": 0.6}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pings", type=int, default=500)
    ap.add_argument("--spawns", type=int, default=15)
    ap.add_argument("--clients", type=int, default=0, help="clients of the load run (0: none)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the load run lasts")
    ap.add_argument("--split", type=int, default=0, help="rounds of spawn(n=40) split over two hosts (0: none)")
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
        load = clients_load(router, hosts, args.clients, args.seconds) if args.clients else None
    paired = statistics.median(r - d for r, d in zip(sr, sd))
    figures = {
        "ping": {"router_p50_ms": ms(r_s), "direct_p50_ms": ms(d_s), "overhead_p50_ms": ms(diffs),
                 "n": args.pings, "target_overhead_ms": 2.0},
        "spawn20": {"router_median_ms": ms(sr), "direct_median_ms": ms(sd),
                    "ratio": round(statistics.median(sr) / statistics.median(sd), 3),
                    "paired_overhead_ms": round(paired * 1000, 3),
                    "paired_ratio": round(1 + paired / statistics.median(sd), 3), "n": args.spawns,
                    "target_ratio": 1.10},
        **({"clients": load} if load else {}),
        **({"spawn40_split": split_run(args.split)} if args.split else {}),
        "load": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(figures))
    else:
        p, s = figures["ping"], figures["spawn20"]
        print(f"ping: router p50 {p['router_p50_ms']} ms, direct p50 {p['direct_p50_ms']} ms, "
              f"overhead (median of paired differences) {p['overhead_p50_ms']} ms (target <= 2 ms)")
        print(f"spawn(n=20): router {s['router_median_ms']} ms, direct {s['direct_median_ms']} ms, "
              f"ratio {s['ratio']}, paired {s['paired_ratio']} (target <= 1.10)")
        if "spawn40_split" in figures:
            f = figures["spawn40_split"]
            print(f"spawn(n=40) split over two hosts via the router {f['router_split_median_ms']} ms, one host "
                  f"alone {f['one_host_median_ms']} ms, ratio {f['ratio']} (target <= 0.6)")
        if load:
            print(f"{load['clients']} clients x {load['seconds']} s: {load['calls']} pings, {load['errors']} errors, "
                  f"p50 {load['p50_ms']} ms, p99 {load['p99_ms']} ms, lost pins {load['lost_pins']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
