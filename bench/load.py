"""Many clients against one ``forkd serve``: the latency of each kind of call, for server settings
compared in turn.

Each client (a thread, spread over several processes so the clients' own Python does not become
the bottleneck) owns an SDK client object and loops until the round ends over one kind of call:
ping, list, eval of ``1`` (a long call), or spawn-then-kill of one sandbox (the kill is timed on its
own). Clients are spread evenly over the kinds. Pings and evals go to one of 20 pre-spawned
sandboxes. Each round starts a fresh server for each setting, in turn, so the load of a busy
machine falls on every setting alike; the figures are the medians over rounds of each round's p50
and p90.

Usage: python3 bench/load.py [--clients 200] [--seconds 20] [--rounds 2] [--json] [--setting=ARGS ...]
(each --setting: the forkd serve options of one setting, e.g. --setting=--ForkdApp.control_workers=64)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import Controller as Client  # noqa: E402
from forkd_server.client import ControllerError  # noqa: E402
from tests.serving import FORKD, free_port  # noqa: E402

KINDS = ("ping", "list", "eval", "spawn", "kill")
LOOPS = ("ping", "list", "eval", "spawn+kill")


def _client_process(url: str, token: str, sandboxes: list[str], loops: list[str], until: float, out) -> None:
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def run(i: int, loop: str) -> None:
        client = Client(url, token, timeout=300)
        mine: dict[str, list[float]] = {k: [] for k in KINDS}
        n = i
        while time.time() < until:
            n += 1
            sid = sandboxes[n % len(sandboxes)]
            try:
                if loop == "ping":
                    t0 = time.perf_counter()
                    client.ping_sandbox(sid)
                    mine["ping"].append(time.perf_counter() - t0)
                elif loop == "list":
                    t0 = time.perf_counter()
                    client.list_sandboxes()
                    mine["list"].append(time.perf_counter() - t0)
                elif loop == "eval":
                    t0 = time.perf_counter()
                    client.eval_code(sid, "1")
                    mine["eval"].append(time.perf_counter() - t0)
                else:
                    t0 = time.perf_counter()
                    new = client.spawn_sandboxes("load", 1)[0]["id"]
                    t1 = time.perf_counter()
                    client.kill_sandbox(new)
                    mine["spawn"].append(t1 - t0)
                    mine["kill"].append(time.perf_counter() - t1)
            except ControllerError as exc:
                with lock:
                    errors[str(exc.status)] = errors.get(str(exc.status), 0) + 1
        with lock:
            for k, v in mine.items():
                samples[k] += v

    threads = [threading.Thread(target=run, args=(i, loop)) for i, loop in enumerate(loops)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((samples, errors))


def one_round(setting: list[str], clients: int, seconds: float, processes: int) -> dict:
    work = tempfile.mkdtemp(prefix="fkl", dir=os.environ.get("FORKD_BENCH_DIR"))
    token = secrets.token_hex(20)
    with open(os.path.join(work, "token"), "w") as f:
        f.write(token)
    port = free_port()
    log = open(os.path.join(work, "serve.log"), "w")
    server = subprocess.Popen([*FORKD, "serve", "--port", str(port), "--data-dir", os.path.join(work, "d"),
                               "--token-file", os.path.join(work, "token"), *setting],
                              stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "JUPYTER_RUNTIME_DIR": os.path.join(work, "rt")})
    url = f"http://127.0.0.1:{port}"
    admin = Client(url, token, timeout=300)
    try:
        admin.wait_ready(60)
        admin.create_snapshot("load", setup="x = 1")
        sandboxes = [s["id"] for s in admin.spawn_sandboxes("load", 20)]
        loops = [LOOPS[i % len(LOOPS)] for i in range(clients)]
        until = time.time() + 3 + seconds  # the processes start within the 3 s
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=_client_process, args=(url, token, sandboxes, loops[p::processes], until, out))
                 for p in range(processes)]
        for p in procs:
            p.start()
        merged: dict[str, list[float]] = {k: [] for k in KINDS}
        errors: dict[str, int] = {}
        for _ in procs:
            samples, errs = out.get(timeout=seconds + 600)
            for k, v in samples.items():
                merged[k] += v
            for k, v in errs.items():
                errors[k] = errors.get(k, 0) + v
        for p in procs:
            p.join()
        return {"errors": errors, **{k: {"p50_ms": round(statistics.median(v) * 1000, 1),
                                         "p90_ms": round(sorted(v)[int(len(v) * 0.9)] * 1000, 1), "n": len(v)}
                                     for k, v in merged.items() if v}}
    finally:
        for sb in admin.list_sandboxes():
            try:
                admin.kill_sandbox(sb["id"])
            except ControllerError:
                pass
        for snap in admin.list_snapshots():
            try:
                admin.delete_snapshot(snap["tag"], cascade=True)
            except ControllerError:
                pass
        server.terminate()
        server.wait(60)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", type=int, default=4, help="client processes the clients are spread over")
    parser.add_argument("--setting", action="append", default=None,
                        help="forkd serve options of one setting (repeat for each; default: the server's defaults)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = args.setting or [""]
    rounds: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings:
            figures = one_round(s.split(), args.clients, args.seconds, args.processes)
            rounds[s].append(figures)
            if not args.json:
                print(f"round {r + 1} [{s or 'defaults'}]: " + ", ".join(
                    f"{k} {figures[k]['p50_ms']} ms (n={figures[k]['n']})" for k in KINDS if k in figures)
                    + (f", errors {figures['errors']}" if figures["errors"] else ""), flush=True)
    summary = {s or "defaults": {k: {q: statistics.median(f[k][q] for f in rs if k in f) for q in ("p50_ms", "p90_ms")}
                                 for k in KINDS if all(k in f for f in rs)}
               for s, rs in rounds.items()}
    out = {"clients": args.clients, "seconds": args.seconds, "rounds": args.rounds, "summary": summary,
           "load_average_at_end": os.getloadavg()[0], "per_round": rounds}
    print(json.dumps(out, indent=1) if args.json else json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
