"""How fast ``forkd serve`` comes back after a ``kill -9`` in the middle of work, on each engine.

Sandboxes and templates outlive the server by design; a restarted server listens at once and
settles what it recorded in the background (each object re-attached if it answers, else ended or
failed with the reason; calls about an object not settled yet answer 503 "recovering").

Method. Per engine, one ``forkd serve`` and one snapshot. Each crash round: ``--workers`` threads
spawn 1-5 sandboxes, branch one (live without waiting, or full, in turn), kill them and delete an
older branch, until a random point (between ``workers`` and ``3 * workers`` finished steps, so calls
are in flight); then ``kill -9`` of the server and a new ``forkd serve`` on the same data dir, timed
from the start of its process:

- ``listen_s``: until ``/healthz`` answers (the API is up; Python's and jupyter-server's own start
  are part of it: ``empty_listen_s`` is the same on an empty data dir, for scale);
- ``settle_s``: until ``/healthz`` no longer says ``recovering`` (every recorded object settled):
  the restart, whole.

The server's own account of its start (``forkd: listening ... s after the process started (stage
+s, ...)``, forkd_server/startup.py) gives the split by stage of each round's ``listen_s``: the
interpreter and the CLI, jupyter-server's import, the extension (registry, engines, recovery's
plan), the web app; ``stages`` has each stage's median and worst over the rounds (``empty_stages``
the same for the empty starts, ``stages_by_round`` each round's).

Then (untimed) a sandbox of the snapshot is spawned and answers, every sandbox is killed and every
other snapshot deleted, and the next round starts. With
``--stale N`` (process engine) one more restart is timed with N sandboxes whose agents are stopped
(SIGSTOP: alive and silent, the worst a restart meets): the port listens while their pings wait
out ``recovery_probe_timeout`` (5 s), all at once, then each is ended.

Targets: ``listen_s`` <= 2 s in every round, the worst ``settle_s`` over the rounds <= 5 s, per engine.

Usage: python3 bench/restart.py [--json] [--rounds 20] [--engines process,vm] [--workers 4] [--stale 100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import Controller as Client  # noqa: E402
from tests.serving import Server, burst, cleanup  # noqa: E402

LISTEN_TARGET_S = 2.0
SETTLE_TARGET_S = 5.0
CALL_TIMEOUT = 120


def start(workdir: str, token_file: str, engine: str) -> Server:
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": os.path.join(workdir, "rt")}
    return Server("--token-file", token_file, f"--ForkdApp.default_engine={engine}", "--ServerApp.log_level=INFO",
                  data_dir=os.path.join(workdir, "d"), env=env)


def timed_start(server: Server) -> tuple[float, float]:
    """(listen_s, settle_s) of a start of ``server``'s process, polling /healthz every 5 ms."""
    t0 = time.monotonic()
    server.start()
    deadline = t0 + 300
    listen = None
    while True:
        try:
            health = server.health()
        except OSError:
            health = None
        now = time.monotonic()
        if health is not None:
            listen = now - t0 if listen is None else listen
            if "recovering" not in health:
                return listen, now - t0
        if now > deadline or server.proc.poll() is not None:
            raise RuntimeError(f"forkd serve did not come back:\n{server.output()[-3000:]}")
        time.sleep(0.005)


STAGES = re.compile(r"forkd: listening ([\d.]+) s after the process started \((.*)\)")


def last_start_stages(server: Server) -> dict[str, float]:
    """The stages of the server's last start, as it logged them (stage -> seconds it took)."""
    found = STAGES.findall(server.output())
    if not found:
        return {}
    total, parts = found[-1]
    stages = {name: float(took) for name, took in (part.rsplit(" +", 1) for part in parts.split(", "))}
    return {**stages, "total (the server's own)": float(total)}


def stage_summary(rounds: list[dict[str, float]]) -> dict:
    names = list(dict.fromkeys(name for r in rounds for name in r))
    return {name: {"median_s": round(statistics.median(r.get(name, 0.0) for r in rounds), 3),
                   "worst_s": round(max(r.get(name, 0.0) for r in rounds), 3)} for name in names}


def clear(client: Client) -> None:
    """Kill every sandbox and delete every snapshot but ``base``."""
    for sb in client.list_sandboxes():
        client.kill_sandbox(sb["id"])
    for snap in client.list_snapshots():
        if snap["tag"] != "base":
            client.delete_snapshot(snap["tag"])


def summary(samples: list[float]) -> dict:
    return {"median_s": round(statistics.median(samples), 3), "worst_s": round(max(samples), 3), "n": len(samples),
            "rounds_s": [round(s, 3) for s in samples]}


def crash_rounds(engine: str, rounds: int, workers: int) -> dict:
    workdir = tempfile.mkdtemp(prefix="fkrb")
    token = secrets.token_hex(20)
    token_file = os.path.join(workdir, "token")
    with open(token_file, "w") as f:
        f.write(token)
    server = start(workdir, token_file, engine)
    client = Client(server.url, token, timeout=CALL_TIMEOUT)
    listen, settle, empty, counts, stages, stages_empty = [], [], [], [], [], []
    try:
        server.wait_healthy(timeout=120)
        client.create_snapshot("base", engine=engine, setup="value = 41",
                               **({"mem_size_mib": 192} if engine == "vm" else {}))
        rng = random.Random(11)
        for _ in range(rounds):
            stop, progress = threading.Event(), threading.Semaphore(0)
            threads = [threading.Thread(target=burst, args=(server.url, token, stop, progress), daemon=True)
                       for _ in range(workers)]
            for t in threads:
                t.start()
            for _ in range(rng.randint(workers, 3 * workers)):
                if not progress.acquire(timeout=CALL_TIMEOUT):
                    raise RuntimeError("the burst did not get going")
            stop.set()
            server.crash()
            got = timed_start(server)
            listen.append(got[0])
            settle.append(got[1])
            stages.append(last_start_stages(server))
            for t in threads:
                t.join(CALL_TIMEOUT + 5)
            counts.append(len(client.list_sandboxes()))
            (kid,) = client.spawn_sandboxes("base", 1)
            assert client.eval_code(kid["id"], "value")["result"] == "41"
            clear(client)  # what the burst left (kills cut short are re-attached): each round starts alike
            empty_s, empty_stages = empty_start(engine)
            empty.append(empty_s)
            stages_empty.append(empty_stages)
        cleanup(server.url, token)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"listen": summary(listen), "settle": summary(settle), "empty_listen": summary(empty),
            "stages": stage_summary(stages), "empty_stages": stage_summary(stages_empty),
            "stages_by_round": stages,
            "sandboxes_listed_after_restart": counts,
            "targets_met": {f"listen <= {LISTEN_TARGET_S:g} s every round": max(listen) <= LISTEN_TARGET_S,
                            f"worst settle <= {SETTLE_TARGET_S:g} s": max(settle) <= SETTLE_TARGET_S}}


def empty_start(engine: str) -> tuple[float, dict[str, float]]:
    """Seconds from starting ``forkd serve`` on an empty data dir until /healthz answers, and its
    stages as it logged them."""
    workdir = tempfile.mkdtemp(prefix="fkre")
    token_file = os.path.join(workdir, "token")
    with open(token_file, "w") as f:
        f.write(secrets.token_hex(20))
    t0 = time.monotonic()
    server = start(workdir, token_file, engine)
    try:
        server.wait_healthy(timeout=120)
        took = time.monotonic() - t0
        return took, last_start_stages(server)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def stale_restart(n: int) -> dict:
    """One restart with ``n`` sandboxes whose agents are stopped (process engine)."""
    workdir = tempfile.mkdtemp(prefix="fkrs")
    token = secrets.token_hex(20)
    token_file = os.path.join(workdir, "token")
    with open(token_file, "w") as f:
        f.write(token)
    server = start(workdir, token_file, "process")
    client = Client(server.url, token, timeout=CALL_TIMEOUT)
    stale: list[dict] = []
    try:
        server.wait_healthy(timeout=120)
        client.create_snapshot("base", engine="process", setup="value = 41")
        stale = client.spawn_sandboxes("base", n)
        server.crash()
        for sb in stale:
            os.kill(sb["pid"], signal.SIGSTOP)
        listen, settle = timed_start(server)
        left = len(client.list_sandboxes())
        cleanup(server.url, token)
    finally:
        for sb in stale:
            try:
                os.kill(sb["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"stale_agents": n, "listen_s": round(listen, 3), "settle_s": round(settle, 3),
            "listed_after_settle": left, f"listen <= {LISTEN_TARGET_S:g} s": listen <= LISTEN_TARGET_S}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--engines", default="process,vm")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--stale", type=int, default=100, help="stopped agents in the stale restart (0: none)")
    args = parser.parse_args()

    out: dict = {"rounds": args.rounds, "workers": args.workers, "cpus": os.cpu_count(),
                 "loadavg_at_start": round(os.getloadavg()[0], 2), "engines": {}}
    for engine in [e for e in args.engines.split(",") if e]:
        out["engines"][engine] = crash_rounds(engine, args.rounds, args.workers)
    if args.stale:
        out["stale"] = stale_restart(args.stale)
    out["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"kill -9 of forkd serve mid-burst ({args.workers} threads), then a restart; {args.rounds} rounds "
          f"per engine (median / worst):")
    for engine, got in out["engines"].items():
        for key, label in (("listen", "start -> /healthz answers"), ("settle", "start -> everything settled"),
                           ("empty_listen", "for scale: an empty data dir -> /healthz")):
            print(f"  {engine:8s} {label:42s} {got[key]['median_s']:7.3f} s / {got[key]['worst_s']:7.3f} s")
        for key, label in (("stages", "after a crash"), ("empty_stages", "on an empty data dir")):
            print(f"  {engine:8s} its start by stage {label} (median / worst): " + ", ".join(
                f"{name} {v['median_s']:.3f} / {v['worst_s']:.3f}" for name, v in got[key].items()))
        print(f"  {engine:8s} targets met: {got['targets_met']}")
    if "stale" in out:
        s = out["stale"]
        print(f"  {s['stale_agents']} stopped agents: listening after {s['listen_s']:.3f} s, settled after "
              f"{s['settle_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
