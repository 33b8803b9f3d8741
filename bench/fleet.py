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
  directly, against the two capped hosts called directly at once (20 each, no router: what the
  machine allows a split; the router's share is the difference), and against one capped host's 20
  alone (``own_cpus_ratio``: what the split would take with each host on CPUs of its own, over one
  host's 40, the router's few ms aside: a projection, not a measurement of two machines); R
  rounds, each arm first in turn; the ratios of the medians to one host's, and ``paired_ratio`` /
  ``paired_direct_ratio``: the median of each round's ratio to that round's one host (the steadier
  figure under load). The direct pair's two calls leave together (a barrier), as the router's two
  parts do. Both hosts share this machine's CPUs, so the split can only gain where spawning waits on
  something else. Run as root, ``cpu`` says per arm (medians) what the hosts spent in CPU time
  (each host's server, templates and sandboxes, in a cgroup of its own: bench/cpu_groups.py), the
  router's, the hosts' CPU time over the wall time (``hosts_cores``), and how many of the machine's
  CPUs were busy meanwhile, everyone's work counted (``machine_busy_cores``).

* ``--cross-vm R``: a VM snapshot (``--cross-mem`` MiB of guest RAM holding ``x = 41``, and with
  ``--cross-numpy-mb M`` M MB of random float64s) not yet on the host it is spawned on. Each of R rounds starts afresh: moto's S3 server on loopback as the shared store, two
  VM-engine hosts with empty data dirs, host 0 capped at 0 sandboxes (full); the snapshot is made on
  host 0 and pushed, then ``spawn(n=1)`` through the router goes to host 1, which pulls it and
  restores the child; timed from the call until the child answers ``eval("x + 1")`` through the
  router. The split comes from host 1's own event timestamps (``/v1/events``, one clock with this
  process's): ``fetch_verify`` (its snapshot row ``writing`` to the pull's last progress event: every
  missing chunk got, decompressed, hashed, written into the snapshot's files, ``memory.bin`` in
  tmpfs, and kept in the local store, in one pass), ``materialise`` (to ``ready``: the files
  renamed into place, the manifest and the snapshot's record written; before the pull was one
  pass, this was the files written from the local store, every chunk verified again), ``pull``
  (the two),
  ``restore`` (``ready`` to the child's ``created`` event: the router's spawn passed on, one loopback
  call, then QEMU restored and the agent's restore confirmed),
  and ``other`` (the rest: placement, the manifest's fetch before the pull, the spawn's reply and
  the eval); beside them ``spawn_reply_ms`` (the call until the router's reply: the child is ready)
  and ``eval_ms`` (then its first eval); ``before_pull_ms`` (the call until host 1's ``writing``).
  With ``--cross-push-on-demand`` the snapshot is not pushed first: the router has host 0 push it
  within the timed call (host 1's first pull answers 404), so ``before_pull_ms`` holds that push.
  Medians over the rounds.

Usage: python3 bench/fleet.py [--json] [--pings 500] [--spawns 15] [--clients 200 --seconds 60] [--split 10]
                              [--cross-vm 3 [--cross-mem 512] [--cross-numpy-mb 100] [--cross-push-on-demand]]   (--pings 0 --spawns 0: skip those)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import statistics
import sys
import threading
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cpu_groups import CpuGroups, spent  # noqa: E402
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
    host doing all 40 directly (its snapshot has a tag of its own, so the router never uses it), and
    against the two capped hosts called directly at once, 20 each (what this machine allows a split
    without the router: the router's own share is the difference)."""
    caps = [["--ForkdApp.max_sandboxes=20"], ["--ForkdApp.max_sandboxes=20"], []]
    groups = CpuGroups.make("forkd-bench-split")
    try:
        return _split_run(rounds, caps, groups)
    finally:
        if groups is not None:
            groups.remove()


def _split_run(rounds: int, caps: list[list[str]], groups: CpuGroups | None) -> dict:
    with fleet(3, host_args=caps, router_args=("--heartbeat", "0.5")) as (router, hosts):
        if groups is not None:  # before the snapshots: each host's templates and sandboxes count to it
            for name, proc in (("h0", hosts[0].proc), ("h1", hosts[1].proc), ("h2", hosts[2].proc),
                               ("router", router.proc)):
                groups.join(name, proc.pid)
        for h in hosts[:2]:
            Controller(h.url, h.token, timeout=300).create_snapshot("split", setup="x = 1")
        Controller(hosts[2].url, hosts[2].token, timeout=300).create_snapshot("alone", setup="x = 1")
        via, alone = Conn(router.url, router.token), Conn(hosts[2].url, hosts[2].token)
        pair = [Conn(h.url, h.token) for h in hosts[:2]]
        capped = {h.url for h in hosts[:2]}

        def room_again() -> None:  # the router's heartbeat has seen the kills on both capped hosts
            deadline = time.monotonic() + 60
            while any((router.hosts()[u]["capacity"] or {}).get("sandboxes") for u in capped):
                if time.monotonic() > deadline:
                    raise RuntimeError("the router never saw the capped hosts empty again")
                time.sleep(0.05)

        def both_direct() -> list[tuple[Conn, list]]:
            got: list = [None, None]
            start = threading.Barrier(2)  # both calls go out together, as the router sends its two parts

            def one(i: int) -> None:
                start.wait()
                got[i] = pair[i].call("POST", "/v1/sandboxes", {"snapshot_tag": "split", "n": 20})
            threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if None in got:
                raise RuntimeError("a direct spawn of 20 failed")
            return list(zip(pair, got))

        times: dict[str, list[float]] = {"router": [], "alone": [], "pair": [], "half": []}
        cpu: dict[str, list[dict]] = {arm: [] for arm in times}
        spread = []
        arms = tuple(times)
        for i in range(rounds):
            for which in arms[i % 4:] + arms[:i % 4]:  # each arm first in turn
                u0 = groups.usage() if groups is not None else None
                t0 = time.perf_counter()
                if which == "pair":
                    made = both_direct()
                elif which == "half":  # one capped host's 20, alone on the machine
                    made = [(pair[0], pair[0].call("POST", "/v1/sandboxes", {"snapshot_tag": "split", "n": 20}))]
                else:
                    conn, tag = (via, "split") if which == "router" else (alone, "alone")
                    made = [(conn, conn.call("POST", "/v1/sandboxes", {"snapshot_tag": tag, "n": 40}))]
                times[which].append(time.perf_counter() - t0)
                if groups is not None:
                    cpu[which].append(spent(u0, groups.usage()))
                if which == "router":
                    spread.append(sorted(sum(k["host"] == u for k in made[0][1]) for u in capped))
                for conn, kids in made:
                    for k in kids:
                        conn.call("DELETE", f"/v1/sandboxes/{k['id']}")
                if which != "alone":
                    room_again()
        clashes = router.output().count("handed out ids in use elsewhere")
    split, single, both, half = times["router"], times["alone"], times["pair"], times["half"]

    def paired(arm: list[float]) -> float:  # round by round against one host's 40 of the same round
        return round(statistics.median(a / b for a, b in zip(arm, single)), 3)

    return {"router_split_median_ms": ms(split), "one_host_median_ms": ms(single),
            "two_hosts_direct_median_ms": ms(both), "one_host_20_median_ms": ms(half),
            "ratio": round(statistics.median(split) / statistics.median(single), 3),
            "direct_ratio": round(statistics.median(both) / statistics.median(single), 3),
            # each host on CPUs of its own: its 20 take what 20 take alone (the router's share, ~4 ms
            # timed inside it, is left out: split minus the direct pair is noise of hundreds of ms)
            "own_cpus_ratio": round(statistics.median(half) / statistics.median(single), 3),
            # round 0 begins with the router's split: the fleet's first spawn on both capped hosts
            "first_split_ms": round(split[0] * 1000, 1), "id_clashes_spawned_again": clashes,
            "split": spread[:3], "n": rounds, "target_ratio": 0.6,
            "paired_ratio": paired(split), "paired_direct_ratio": paired(both),
            **({"cpu": cpu_figures(times, cpu)} if any(cpu.values()) else {})}


def cpu_figures(times: dict[str, list[float]], cpu: dict[str, list[dict]]) -> dict:
    """Per arm, medians: the CPU time the hosts spent (each host's server, templates and sandboxes),
    the router's, and how many of the machine's CPUs were busy (everyone's work) while it ran."""
    out = {}
    for arm, rows in cpu.items():
        hosts = [sum(v for k, v in r.items() if k.startswith("h")) for r in rows]
        out[arm] = {"hosts_cpu_ms": ms(hosts), "router_cpu_ms": ms([r["router"] for r in rows]),
                    "hosts_cores": round(statistics.median(h / t for h, t in zip(hosts, times[arm])), 2),
                    "machine_busy_cores": round(statistics.median(r["machine_busy"] / t
                                                                  for r, t in zip(rows, times[arm])), 2)}
    return out


def cross_vm_round(prefix: str, mem_mib: int, numpy_mb: int, push_first: bool = True) -> dict:
    """One spawn of a VM snapshot that host 1 has never seen: pushed by host 0 (full), pulled by
    host 1; without ``push_first`` the router has host 0 push it on demand, within the timed call."""
    store = ["--store", f"s3://forkd/{prefix}"]
    with fleet(2, host_args=[[*store, "--ForkdApp.max_sandboxes=0"], store], router_args=("--heartbeat", "0.5")) \
            as (router, hosts):
        h0, h1 = (Controller(h.url, h.token, timeout=900) for h in hosts)
        api = Controller(router.url, router.token, timeout=900)
        if numpy_mb:  # random float64s: incompressible, as bench/store.py's guest
            h0.create_snapshot("cross", engine="vm", mem_size_mib=mem_mib, packages=["python3-numpy"],
                               setup=f"import numpy as np\narr = np.random.default_rng(1).random({numpy_mb * 125_000})\n"
                                     "x = 41")
        else:
            h0.create_snapshot("cross", engine="vm", mem_size_mib=mem_mib, setup="x = 41")
        deadline = time.monotonic() + 900  # its durable copy in host 0's local store is written first
        while not h0.snapshot_info("cross").get("stored"):
            if time.monotonic() > deadline:
                raise RuntimeError("host 0 never wrote snapshot cross to its local store")
            time.sleep(0.1)
        pushed = h0.push_snapshot("cross") if push_first else {}
        assert "cross" not in {s["tag"] for s in h1.list_snapshots()}
        router.wait(lambda h: h["hosts_up"] >= 2, "see both hosts up")
        seen: list[dict] = []
        stream = h1.events()  # open before the spawn: no event of host 1's is missed

        listener = threading.Thread(target=seen.extend, args=(stream,), daemon=True)
        listener.start()
        t0, p0 = time.time(), time.perf_counter()
        kid = api.spawn_sandboxes("cross", 1)[0]
        replied = time.perf_counter() - p0
        answer = api.eval_code(kid["id"], "x + 1")["result"]
        total = time.perf_counter() - p0
        stream.close()
        listener.join(10)
        assert kid["host"] == hosts[1].url and answer == "42", (kid, answer)
        info = h1.snapshot_info("cross")
        api.kill_sandbox(kid["id"])

    def when(kind: str, action: str, **match) -> float:
        for e in seen:
            if e["kind"] == kind and e["action"] == action and all(e.get(k) == v for k, v in match.items()):
                return e["time"]
        raise RuntimeError(f"host 1 sent no {kind} {action} event {match}: {seen}")

    writing = when("snapshot", "created", tag="cross")
    fetched = max(e["time"] for e in seen if e["kind"] == "snapshot" and e["action"] == "pull"
                  and e.get("done_bytes") == e.get("total_bytes"))
    ready = when("snapshot", "status", tag="cross", status="ready")
    restored = when("sandbox", "created", id=kid["id"])
    split = {"fetch_verify": fetched - writing, "materialise": ready - fetched, "pull": ready - writing,
             "restore": restored - ready}
    split["other"] = total - split["pull"] - split["restore"]
    return {"total_ms": round(total * 1000, 1), "spawn_reply_ms": round(replied * 1000, 1),
            "eval_ms": round((total - replied) * 1000, 1), **{f"{k}_ms": round(v * 1000, 1) for k, v in split.items()},
            "before_pull_ms": round((writing - t0) * 1000, 1), "pushed_bytes": pushed.get("uploaded_bytes"),
            "chunks": pushed.get("chunks"), "stored": info.get("stored")}


def cross_vm_run(rounds: int, mem_mib: int, numpy_mb: int, push_first: bool = True) -> dict:
    """``rounds`` cross-host spawns, each with fresh hosts and a fresh store prefix; medians."""
    from tests.store.s3 import S3_ENV, moto_s3

    runs = []
    with contextlib.redirect_stdout(sys.stderr), moto_s3() as (endpoint, _log):  # moto prints a line: keep --json clean
        env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        os.environ.update(env)  # the hosts inherit it (fleet() passes os.environ)
        try:
            for i in range(rounds):
                runs.append(cross_vm_round(f"cross{i}-{os.getpid()}", mem_mib, numpy_mb, push_first))
        finally:
            for name in env:
                os.environ.pop(name, None)
    keys = [k for k in runs[0] if k.endswith("_ms")]
    return {"guest_ram_mib": mem_mib, "numpy_mb": numpy_mb, "pushed_first": push_first, "n": rounds, **{k: round(statistics.median(r[k] for r in runs), 1) for k in keys},
            "runs": runs, "target_ms": 3000}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pings", type=int, default=500)
    ap.add_argument("--spawns", type=int, default=15)
    ap.add_argument("--clients", type=int, default=0, help="clients of the load run (0: none)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the load run lasts")
    ap.add_argument("--split", type=int, default=0, help="rounds of spawn(n=40) split over two hosts (0: none)")
    ap.add_argument("--cross-vm", type=int, default=0,
                    help="rounds of a cross-host spawn of a VM snapshot not yet on the host (0: none)")
    ap.add_argument("--cross-mem", type=int, default=512, help="guest RAM of that snapshot, MiB")
    ap.add_argument("--cross-numpy-mb", type=int, default=0, help="MB of random float64s it holds (0: just x = 41)")
    ap.add_argument("--cross-push-on-demand", action="store_true",
                    help="do not push it first: the router has its host push it within the timed spawn")
    args = ap.parse_args()
    figures = {}
    if args.pings and args.spawns:
        figures.update(router_overhead(args))
    if args.split:
        figures["spawn40_split"] = split_run(args.split)
    if args.cross_vm:
        figures["cross_vm"] = cross_vm_run(args.cross_vm, args.cross_mem, args.cross_numpy_mb,
                                          push_first=not args.cross_push_on_demand)
    figures["load"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(figures))
        return 0
    if "ping" in figures:
        p, s = figures["ping"], figures["spawn20"]
        print(f"ping: router p50 {p['router_p50_ms']} ms, direct p50 {p['direct_p50_ms']} ms, "
              f"overhead (median of paired differences) {p['overhead_p50_ms']} ms (target <= 2 ms)")
        print(f"spawn(n=20): router {s['router_median_ms']} ms, direct {s['direct_median_ms']} ms, "
              f"ratio {s['ratio']}, paired {s['paired_ratio']} (target <= 1.10)")
    if "spawn40_split" in figures:
        f = figures["spawn40_split"]
        print(f"spawn(n=40) split over two hosts via the router {f['router_split_median_ms']} ms, one host "
              f"alone {f['one_host_median_ms']} ms, ratio {f['ratio']} (target <= 0.6); both capped hosts called "
              f"directly at once {f['two_hosts_direct_median_ms']} ms, ratio {f['direct_ratio']}; one capped host's 20 alone "
              f"{f['one_host_20_median_ms']} ms, so each host on CPUs of its own: ratio {f['own_cpus_ratio']}")
    if "clients" in figures:
        load = figures["clients"]
        print(f"{load['clients']} clients x {load['seconds']} s: {load['calls']} pings, {load['errors']} errors, "
              f"p50 {load['p50_ms']} ms, p99 {load['p99_ms']} ms, lost pins {load['lost_pins']}")
    if "cross_vm" in figures:
        c = figures["cross_vm"]
        print(f"cross-host spawn of a {c['guest_ram_mib']} MiB VM snapshot ({c['numpy_mb']} MB of numpy), first child "
              f"answering: {c['total_ms']} ms "
              f"(target <= 3000) = pull {c['pull_ms']} (fetch + verify {c['fetch_verify_ms']}, materialise "
              f"{c['materialise_ms']}) + restore {c['restore_ms']} + other {c['other_ms']} (before the pull "
              f"{c['before_pull_ms']}); median of {c['n']}")
    return 0


def router_overhead(args) -> dict:
    """The ping, spawn(n=20) and --clients figures: the router against the host called directly."""
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
    return {
        "ping": {"router_p50_ms": ms(r_s), "direct_p50_ms": ms(d_s), "overhead_p50_ms": ms(diffs),
                 "n": args.pings, "target_overhead_ms": 2.0},
        "spawn20": {"router_median_ms": ms(sr), "direct_median_ms": ms(sd),
                    "ratio": round(statistics.median(sr) / statistics.median(sd), 3),
                    "paired_overhead_ms": round(paired * 1000, 3),
                    "paired_ratio": round(1 + paired / statistics.median(sd), 3), "n": args.spawns,
                    "target_ratio": 1.10},
        **({"clients": load} if load else {}),
    }


if __name__ == "__main__":
    sys.exit(main())
