"""What the REST layer costs: forkd serve + HTTP versus a direct, in-process controller call.

Two operations, as issue 5's target states them (REST adds <= 2 ms p50):
  * ``POST /v1/sandboxes/{id}/ping`` versus ``Controller.ping(id)``, on one real sandbox;
  * ``GET /v1/sandboxes`` versus ``Controller.list_sandboxes()`` with 1000 registered sandboxes.
And one under load, as issue 11's target states it (p99 <= 50 ms): ping of an idle sandbox while
64 long calls run (64 other sandboxes each in an eval of ``time.sleep(1e6)``, until DELETE).

Method. One data dir, a Controller in this process (the direct calls) and ``forkd serve`` on the
same data dir (a subprocess, as users run it; it attaches to the same sandbox). Each round times
every way once, in turn (the direct call first, the REST ways after it rotated round by round:
which comes first after a pause matters), so the load of a busy machine falls on all ways alike;
the overhead is the median of the paired differences (REST minus direct), and the p50s are
reported too. REST ways:
the client SDK (urllib, a new TCP connection per call: what ``forkd_server.client`` users get),
one keep-alive connection (http.client: what a long-lived client such as a browser gets) with the
JSON reply parsed, and for the list also unparsed (the server's share alone).

The 1000 sandboxes: one is real; the other 999 are rows inserted straight into the registry
(status running) that carry the real sandbox's handle. Listing checks on every call that each
row's process is alive; the engine watches each process through a pidfd and polls them all in one
call, so the 999 copies share the real one's pidfd (one fd polled instead of 1000, one syscall
either way). Decoded rows, sandbox infos and their JSON are reused while the registry is unchanged
(its generation), on both sides alike, as between two polls of a UI. No other call touches them; they are deleted before anything else runs.

And the client SDK's own share: its ping on its kept connection against a raw ``http.client``
keep-alive ping in the same rounds, as raw p50 plus the median of the paired differences, over raw
p50 (target <= 1.1; the plain ratio of p50s is printed too); and the throughput of
``asyncio.gather`` of 200 pings from one ``AsyncController`` against 200 sequential pings of the
sync ``Controller`` (target >= 2x), alternating rounds, ratio of the median round times. Both ends
share the machine's two cores: the server's CPU per ping bounds what concurrency can gain.

Usage: python3 bench/api.py [--json] [--iterations 500] [--sandboxes 1000] [--sdk-only]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import AsyncController  # noqa: E402
from forkd_server.client import Controller as Client  # noqa: E402
from forkd_server.controller import Controller  # noqa: E402
from tests.serving import FORKD, free_port  # noqa: E402


class _Done(Exception):
    """--sdk-only: the SDK's figures are in."""


def stats(samples_s: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples_s)
    return {"p50_ms": round(statistics.median(ms), 4), "p90_ms": round(ms[int(len(ms) * 0.9) - 1], 4),
            "mean_ms": round(statistics.fmean(ms), 4), "n": len(ms)}


def timeit(fn, n: int, warmup: int = 20) -> dict:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return stats(samples)


def fake_rows(count: int, real: dict) -> list[dict]:
    """Registry rows that look like ``real`` (same handle, so the liveness check passes)."""
    now = time.time()
    return [{"id": f"sb-fffffff0-{i:04x}", "snapshot_tag": real["snapshot_tag"], "engine": real["engine"],
             "status": "running", "created_at": now, "lineage": [real["snapshot_tag"], f"sb-fffffff0-{i:04x}"],
             "memory_limit_mib": None, "handle": real["handle"]} for i in range(count)]


def percentile(samples_s: list[float], q: float) -> float:
    ms = sorted(s * 1000 for s in samples_s)
    return round(ms[min(len(ms) - 1, int(len(ms) * q))], 4)


PLAIN_PINGS = "forkd_plain_pings_total"  # pings forkd serve answered without a RequestHandler (plain_ping.py)


def metric(client, name: str) -> float | None:
    for line in client.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def ping_while_stuck(client, port: int, token: str, idle: str, stuck_count: int, n: int, keepalive) -> dict:
    """p50/p99 of ping (keep-alive) of an idle sandbox while ``stuck_count`` evals sleep in others."""
    stuck = [s["id"] for s in client.spawn_sandboxes("bench", n=stuck_count)]

    def sleep_forever(sid: str) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/sandboxes/{sid}/eval", method="POST",
                                     data=b'{"code": "__import__(\'time\').sleep(1e6)"}',
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    pool = ThreadPoolExecutor(stuck_count)
    try:
        calls = [pool.submit(sleep_forever, sid) for sid in stuck]
        deadline = time.monotonic() + 120
        while metric(client, "forkd_long_calls_running") != stuck_count:  # readiness, bounded
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {stuck_count} evals did not all start")
            time.sleep(0.05)
        ping_path = f"/v1/sandboxes/{idle}/ping"
        for _ in range(20):
            keepalive("POST", ping_path)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            keepalive("POST", ping_path)
            samples.append(time.perf_counter() - t0)
        still_running = metric(client, "forkd_long_calls_running")
    finally:
        for sid in stuck:  # frees the stuck calls (each answers 410)
            client.kill_sandbox(sid)
        answers = sorted({c.result(120) for c in calls}) if "calls" in locals() else []
        pool.shutdown()
    return {**stats(samples), "p99_ms": percentile(samples, 0.99), "long_calls_running": still_running,
            "stuck_calls_answered_after_delete": answers, "target_p99_ms": 50.0,
            "target_met": percentile(samples, 0.99) <= 50.0}


def serve_over(data: str, command: list[str] = FORKD) -> tuple[subprocess.Popen, str, str, Client]:
    """``forkd serve`` over the data dir ``data`` (made by an in-process Controller) with a fresh
    token: (its process, URL, token, a client), once it has settled what the data dir holds (it
    listens first, and lists a sandbox only once that sandbox is settled). ``command`` runs the
    ``forkd`` CLI (bench/ping_calls.py's runs it under a profiler)."""
    token = secrets.token_hex(20)
    token_file = os.path.join(data, "token")
    with open(token_file, "w") as f:
        f.write(token)
    port = free_port()
    server = subprocess.Popen([*command, "serve", "--port", str(port), "--data-dir", data,
                               "--token-file", token_file, "--ServerApp.log_level=WARN"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = Client(url, token)
    client.wait_ready(60)
    deadline = time.monotonic() + 60
    while client.healthz().get("recovering"):
        if time.monotonic() > deadline:
            server.kill()
            raise SystemExit("forkd serve did not settle the bench's data dir within 60 s")
        time.sleep(0.05)
    return server, url, token, client


def stop_and_clean(server: subprocess.Popen | None, ctl: Controller | None, data: str) -> None:
    """Stop ``serve_over``'s server and end everything the bench made: nothing may outlive it."""
    if server is not None:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    if ctl is not None:
        for sb in ctl.list_sandboxes():
            ctl.kill_sandbox(sb["id"])
        for snap in ctl.list_snapshots():
            ctl.delete_snapshot(snap["tag"])
        ctl.close()
    shutil.rmtree(data, ignore_errors=True)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sdk_concurrency(client, url: str, token: str, sids: list[str], rounds: int, server_pid: int,
                    calls: int = 200) -> dict:
    """Seconds for ``calls`` sequential sync pings and for ``asyncio.gather`` of as many from one
    AsyncController, in alternating rounds on one event loop (its pool made once); the pings go to
    ``sids`` in turn. With each, the server's CPU per ping (what bounds the gathered rate)."""

    async def run() -> dict:
        async with AsyncController(url, token) as actl:
            async def gathered() -> float:
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(actl.ping_sandbox(sids[i % len(sids)]) for i in range(calls)))
                assert len(answers) == calls
                return time.perf_counter() - t0

            def sequential() -> float:
                t0 = time.perf_counter()
                for i in range(calls):
                    client.ping_sandbox(sids[i % len(sids)])
                return time.perf_counter() - t0

            await gathered()  # the pool's connections opened, as in a long-lived service
            sequential()
            plain0 = metric(client, PLAIN_PINGS) or 0.0
            seq, gat, seq_cpu, gat_cpu = [], [], [], []
            for _ in range(rounds):
                cpu0 = process_cpu_s(server_pid)
                seq.append(sequential())
                cpu1 = process_cpu_s(server_pid)
                gat.append(await gathered())
                seq_cpu.append(cpu1 - cpu0)
                gat_cpu.append(process_cpu_s(server_pid) - cpu1)
            return {"sequential_sync_s": seq, "gather_async_s": gat, "server_cpu_sequential_s": seq_cpu,
                    "server_cpu_gather_s": gat_cpu, "max_connections": actl.max_connections,
                    "plain": (metric(client, PLAIN_PINGS) or 0.0) - plain0}

    got = asyncio.run(run())
    seq, gat = statistics.median(got["sequential_sync_s"]), statistics.median(got["gather_async_s"])
    plain = got.pop("plain")
    return {"calls": calls, "sandboxes": len(sids), "rounds": rounds, "max_connections": got["max_connections"],
            "plain_ping_share": round(plain / (2 * calls * rounds), 3),
            "sequential_sync_median_s": round(seq, 4), "gather_async_median_s": round(gat, 4),
            "sequential_sync_per_s": round(calls / seq), "gather_async_per_s": round(calls / gat),
            "throughput_ratio": round(seq / gat, 3), "target_ratio": 2.0, "target_met": seq / gat >= 2.0,
            "server_cpu_ms_per_ping": {
                "sequential": round(statistics.median(got["server_cpu_sequential_s"]) / calls * 1000, 3),
                "gather": round(statistics.median(got["server_cpu_gather_s"]) / calls * 1000, 3)},
            "rounds_s": {k: [round(x, 4) for x in v] for k, v in got.items() if k.endswith("_s")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iterations", type=int, default=500, help="samples of ping (list: a fifth of it)")
    parser.add_argument("--sandboxes", type=int, default=1000, help="registered sandboxes for the list test")
    parser.add_argument("--stuck", type=int, default=64, help="long calls running during the ping-under-load test")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of 200 sequential / gathered pings")
    parser.add_argument("--sdk-only", action="store_true", help="only the ping and the SDK's figures")
    args = parser.parse_args()
    n_list = max(50, args.iterations // 5)

    data = tempfile.mkdtemp(prefix="fkb")
    out: dict = {"iterations_ping": args.iterations, "iterations_list": n_list, "registered_sandboxes": args.sandboxes,
                 "real_sandboxes": 1, "registry_rows_inserted_directly": args.sandboxes - 1,
                 "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()[0]}
    fakes: list[dict] = []
    server = ctl = None
    try:
        ctl = Controller(data)
        ctl.create_snapshot("bench", setup="x = 1")
        sid = ctl.spawn("bench", 1)[0]["id"]
        server, url, token, client = serve_over(data)
        port = int(url.rsplit(":", 1)[1])
        assert [s["id"] for s in client.list_sandboxes()] == [sid], "the server does not see the sandbox"
        conn = http.client.HTTPConnection("127.0.0.1", port)
        headers = {"Authorization": f"Bearer {token}"}

        def keepalive(method: str, path: str) -> bytes:
            conn.request(method, path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200, (resp.status, body)
            return body

        def measure(ways: dict, n: int, warmup: int) -> dict:
            """Interleaved samples (each round runs every way once), so load noise hits all alike.
            The direct call goes first and the REST ways follow it in turn, rotated each round: the
            REST call right after the direct one (the server idle meanwhile) and the one after
            another REST call differ by ~0.1 ms, either way, so each takes both places as often."""
            for fn in ways.values():
                for _ in range(warmup):
                    fn()
            samples: dict = {name: [] for name in ways}
            first, rest = list(ways.items())[:1], list(ways.items())[1:]
            for i in range(n):
                shift = i % len(rest)
                for name, fn in first + rest[shift:] + rest[:shift]:
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
            result = {name: stats(s) for name, s in samples.items()}
            for name in ways:
                if name != "direct":
                    result[f"overhead_p50_ms_{name}"] = round(result[name]["p50_ms"] - result["direct"]["p50_ms"], 4)
                    paired = [r - d for r, d in zip(samples[name], samples["direct"])]
                    result[f"overhead_paired_median_ms_{name}"] = round(statistics.median(paired) * 1000, 4)
            if "rest_sdk" in ways and "rest_keepalive" in ways:  # the SDK's own share, paired
                paired = [s - k for s, k in zip(samples["rest_sdk"], samples["rest_keepalive"])]
                result["sdk_minus_keepalive_paired_median_ms"] = round(statistics.median(paired) * 1000, 4)
            return result

        ping_path = f"/v1/sandboxes/{sid}/ping"
        out["ping"] = measure({
            "direct": lambda: ctl.ping(sid),
            "rest_sdk": lambda: client.ping_sandbox(sid),
            "rest_keepalive": lambda: json.loads(keepalive("POST", ping_path)),
        }, args.iterations, 20)
        p = out["ping"]
        raw_p50, adds = p["rest_keepalive"]["p50_ms"], p["sdk_minus_keepalive_paired_median_ms"]
        ratio = (raw_p50 + adds) / raw_p50  # paired: each round's SDK ping against the same round's raw one
        out["sdk_ping_vs_raw_keepalive"] = {
            "sdk_p50_ms": p["rest_sdk"]["p50_ms"], "raw_http_client_p50_ms": raw_p50,
            "ratio_p50": round(p["rest_sdk"]["p50_ms"] / raw_p50, 3), "sdk_adds_paired_median_ms": adds,
            "ratio_paired": round(ratio, 3), "target_ratio": 1.1, "target_met": ratio <= 1.1}
        out["sdk_concurrency"] = sdk_concurrency(client, f"http://127.0.0.1:{port}", token, [sid], args.rounds, server.pid)
        spread = [sid, *(s["id"] for s in ctl.spawn("bench", 7))]  # the same, over 8 sandboxes' agents
        out["sdk_concurrency_8_sandboxes"] = sdk_concurrency(client, f"http://127.0.0.1:{port}", token, spread,
                                                             args.rounds, server.pid)
        for other in spread[1:]:
            ctl.kill_sandbox(other)
        if args.sdk_only:
            raise _Done
        fakes = fake_rows(args.sandboxes - 1, ctl.registry.get_sandbox(sid))
        ctl.registry.insert_sandboxes(fakes)
        try:
            assert len(ctl.list_sandboxes()) == args.sandboxes == len(client.list_sandboxes())
            out["list_sandboxes"] = measure({
                "direct": ctl.list_sandboxes,
                "rest_sdk": client.list_sandboxes,
                "rest_keepalive": lambda: json.loads(keepalive("GET", "/v1/sandboxes")),
                "rest_keepalive_unparsed": lambda: keepalive("GET", "/v1/sandboxes"),
            }, n_list, 5)
            out["list_sandboxes"]["response_bytes"] = len(keepalive("GET", "/v1/sandboxes"))
        finally:
            ctl.registry.delete_sandboxes([r["id"] for r in fakes])
        out["ping_while_long_calls_run"] = ping_while_stuck(client, port, token, sid, args.stuck, args.iterations,
                                                            keepalive)
        out["ping_while_long_calls_run"]["long_calls"] = args.stuck
        conn.close()
    except _Done:
        pass
    finally:
        if ctl is not None:  # rows only, no process: not the server's to end
            ctl.registry.delete_sandboxes([r["id"] for r in fakes])
        stop_and_clean(server, ctl, data)

    out["target_ms"] = 2.0
    out["target_met"] = {op: {k.removeprefix("overhead_paired_median_ms_"): v <= 2.0 for k, v in out[op].items()
                              if k.startswith("overhead_paired_median_ms_")} for op in ("ping", "list_sandboxes")
                         if op in out}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        o = out["sdk_ping_vs_raw_keepalive"]
        print(f"SDK ping {o['sdk_p50_ms']:.3f} ms vs raw keep-alive {o['raw_http_client_p50_ms']:.3f} ms (p50), "
              f"+{o['sdk_adds_paired_median_ms']:.3f} ms paired: {o['ratio_paired']:.3f}x "
              f"(target <= 1.1: {'met' if o['target_met'] else 'NOT met'})")
        for key in ("sdk_concurrency", "sdk_concurrency_8_sandboxes"):
            o = out[key]
            print(f"200 pings of {o['sandboxes']} sandbox(es): sequential sync {o['sequential_sync_median_s'] * 1000:.0f} ms, "
                  f"gathered async {o['gather_async_median_s'] * 1000:.0f} ms: {o['throughput_ratio']:.2f}x the "
                  f"throughput (target >= 2: {'met' if o['target_met'] else 'NOT met'}); the server's CPU per ping "
                  f"{o['server_cpu_ms_per_ping']['sequential']:.2f} / {o['server_cpu_ms_per_ping']['gather']:.2f} ms")
        if args.sdk_only:
            return 0
        for op in ("ping", "list_sandboxes"):
            o = out[op]
            print(f"{op}: direct p50 {o['direct']['p50_ms']:.3f} ms")
            for k, v in o.items():
                if k.startswith("overhead_paired_median_ms_"):
                    way = k.removeprefix("overhead_paired_median_ms_")
                    print(f"  {way:24s} p50 {o[way]['p50_ms']:8.3f} ms   adds {v:7.3f} ms (paired median)")
        o = out["ping_while_long_calls_run"]
        print(f"ping while {o['long_calls']} long calls run: p50 {o['p50_ms']:.3f} ms, p99 {o['p99_ms']:.3f} ms "
              f"(target p99 <= 50 ms: {'met' if o['target_met'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
