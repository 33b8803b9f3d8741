"""Where the CPU of a ping goes: the server's, the client's and the agent's, per ping.

One data dir, one sandbox, ``forkd serve`` on it (a subprocess); then, for ``--seconds``, rounds of
200 pings back to back: gathered on one ``AsyncController`` (``--mode gather``) or one by one from
the sync ``Controller`` (``--mode sequential``). Each process's user + system CPU over the rounds
(``/proc/PID/stat``: the server's, this process's, the sandbox agent's) divided by the pings, and
the wall time per ping. Compare trees by alternating runs of each (the machine's load falls on
both alike); see bench/RESULTS.md.

Usage: python3 bench/ping_cpu.py [--mode gather|sequential] [--seconds 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.api import process_cpu_s, serve_over, stop_and_clean
from forkd_server.client import AsyncController
from forkd_server.client import Controller as Client
from forkd_server.controller import Controller

ROUND = 200


async def rounds(url: str, token: str, client: Client, sid: str, mode: str, seconds: float, pids: dict) -> dict:
    async with AsyncController(url, token) as actl:
        async def one_round() -> None:
            if mode == "gather":
                await asyncio.gather(*(actl.ping_sandbox(sid) for _ in range(ROUND)))
            else:
                for _ in range(ROUND):
                    client.ping_sandbox(sid)

        await one_round()  # connections opened, as in a long-lived client
        cpu0 = {name: process_cpu_s(pid) for name, pid in pids.items()}
        pings, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await one_round()
            pings += ROUND
        wall = time.perf_counter() - t0
        cpu = {name: process_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    return {"mode": mode, "pings": pings, "wall_us_per_ping": round(wall / pings * 1e6, 1),
            "cpu_us_per_ping": {name: round(s / pings * 1e6, 1) for name, s in cpu.items()},
            "clock_ticks_per_s": os.sysconf("SC_CLK_TCK")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("gather", "sequential"), default="gather")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    data = tempfile.mkdtemp(prefix="fkc")
    ctl = Controller(data)
    server = None
    try:
        ctl.create_snapshot("bench", setup="x = 1")
        sid = ctl.spawn("bench", 1)[0]["id"]
        server, url, token, client = serve_over(data)
        pids = {"server": server.pid, "client": os.getpid(),
                "agent": ctl.registry.get_sandbox(sid)["handle"]["pid"]}
        out = asyncio.run(rounds(url, token, client, sid, args.mode, args.seconds, pids))
    finally:
        stop_and_clean(server, ctl, data)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        cpu = out["cpu_us_per_ping"]
        print(f"{out['pings']} pings ({out['mode']}): {out['wall_us_per_ping']:.0f} us a ping; CPU a ping: server "
              f"{cpu['server']:.0f} us, client {cpu['client']:.0f} us, agent {cpu['agent']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
