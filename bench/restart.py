"""How fast a server restart re-attaches to live sandboxes (issue 11's target: <= 2 s for 100).

Sandboxes outlive ``forkd serve`` by design; a restarted server re-attaches to them: it checks
that each template and sandbox it recorded is alive and answers its agent, and marks what does not
as failed (snapshots) or drops it (sandboxes), with a reason.

Method. One data dir, one snapshot and N live sandboxes (process engine). Each round:

1. ``kill -9`` of ``forkd serve``;
2. ``reconcile``: a Controller opened on the data dir in this process (engines, registry, the
   re-attach with its agent pings), timed alone, then closed;
3. ``forkd serve`` started again; timed from the start of the process until ``/healthz`` answers,
   until ``GET /v1/sandboxes`` lists all N running, and until every one answered a ping through it.

Figures are medians over the rounds (and the max). Python's start-up and jupyter-server's own are
part of step 3; step 2 is what the re-attach itself costs. For scale, ``empty_healthz`` is the same
start of ``forkd serve`` on an empty data dir (nothing to re-attach), once per round.

Usage: python3 bench/restart.py [--json] [--sandboxes 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import Controller as Client  # noqa: E402
from forkd_server.client import ServerUnreachable  # noqa: E402
from forkd_server.controller import Controller  # noqa: E402
from tests.serving import FORKD, free_port  # noqa: E402

TARGET_S = 2.0


def start_server(data: str, port: int, token_file: str) -> subprocess.Popen:
    return subprocess.Popen([*FORKD, "serve", "--port", str(port), "--data-dir", data, "--token-file", token_file,
                             "--ServerApp.log_level=WARN"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def until(what: str, check, deadline: float) -> None:
    """Bounded polling of ``check`` (every 10 ms) until it is true."""
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within the deadline")
        time.sleep(0.01)


def healthy(client: Client) -> bool:
    try:
        client.healthz()
        return True
    except ServerUnreachable:
        return False


def empty_start(token: str, token_file: str) -> float:
    """Seconds from starting ``forkd serve`` on an empty data dir until /healthz answers."""
    data = tempfile.mkdtemp(prefix="fkr")
    port = free_port()
    client = Client(f"http://127.0.0.1:{port}", token)
    t0 = time.monotonic()
    server = start_server(data, port, token_file)
    try:
        until("healthz (empty)", lambda: healthy(client), t0 + 60)
        return time.monotonic() - t0
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(data, ignore_errors=True)


def summary(samples: list[float]) -> dict:
    return {"p50_s": round(statistics.median(samples), 3), "max_s": round(max(samples), 3), "n": len(samples)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sandboxes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    data = tempfile.mkdtemp(prefix="fkr")
    token = secrets.token_hex(20)
    token_file = os.path.join(data, "token")
    with open(token_file, "w") as f:
        f.write(token)
    port = free_port()
    client = Client(f"http://127.0.0.1:{port}", token, timeout=60)
    rounds: dict[str, list[float]] = {"reconcile": [], "healthz": [], "all_listed": [], "all_pinged": [],
                                      "empty_healthz": []}
    counts = []
    server = start_server(data, port, token_file)
    out: dict = {"sandboxes": args.sandboxes, "rounds": args.rounds, "cpus": os.cpu_count(),
                 "loadavg_at_start": os.getloadavg()[0]}
    try:
        client.wait_ready(60)
        client.create_snapshot("restart-bench", setup="x = 1", engine="process")
        ids = {s["id"] for s in client.spawn_sandboxes("restart-bench", args.sandboxes)}
        for _ in range(args.rounds):
            server.kill()
            server.wait()
            t0 = time.monotonic()
            ctl = Controller(data)
            rounds["reconcile"].append(time.monotonic() - t0)
            counts.append({k: v for k, v in ctl.recovered.items() if k != "findings"})
            ctl.close()
            t0 = time.monotonic()
            server = start_server(data, port, token_file)
            deadline = t0 + 60
            until("healthz", lambda: healthy(client), deadline)
            rounds["healthz"].append(time.monotonic() - t0)
            until("all listed", lambda: {s["id"] for s in client.list_sandboxes() if s["status"] == "running"} == ids,
                  deadline)
            rounds["all_listed"].append(time.monotonic() - t0)
            for sid in ids:
                assert client.ping_sandbox(sid)["pong"] is True
            rounds["all_pinged"].append(time.monotonic() - t0)
            rounds["empty_healthz"].append(empty_start(token, token_file))
    finally:
        try:
            if server.poll() is None:
                for sb in client.list_sandboxes():
                    client.kill_sandbox(sb["id"])
                for snap in client.list_snapshots():
                    client.delete_snapshot(snap["tag"], cascade=True)
        finally:
            server.terminate()
            server.wait(30)
            shutil.rmtree(data, ignore_errors=True)

    out.update({name: summary(s) for name, s in rounds.items()})
    out["reconcile_counts_last_round"] = counts[-1] if counts else None
    out["target_s"] = TARGET_S
    out["target_met"] = {"reconcile": out["reconcile"]["max_s"] <= TARGET_S,
                         "serve_restart_to_all_listed": out["all_listed"]["max_s"] <= TARGET_S}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{args.sandboxes} sandboxes, {args.rounds} kill -9 rounds (median / max):")
        for name, label in (("reconcile", "re-attach (Controller opened in-process)"),
                            ("healthz", "forkd serve start -> /healthz"),
                            ("all_listed", "forkd serve start -> all listed running"),
                            ("all_pinged", "forkd serve start -> all answered a ping"),
                            ("empty_healthz", "for scale: an empty data dir -> /healthz")):
            print(f"  {label:44s} {out[name]['p50_s']:7.3f} s / {out[name]['max_s']:7.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
