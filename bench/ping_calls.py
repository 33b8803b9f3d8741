"""How many Python calls the server's event loop makes per gathered ping: a count, not a timing.

CPU time per ping (bench/ping_cpu.py) moves with the machine's load, by 15% and more on a shared
host; the number of Python function calls on the server's event-loop thread (cProfile's count, C
built-ins included) does not, so two trees compare in one run each. ``forkd serve`` runs over one
sandbox with a profiler that two real-time signals switch on and off around ``--rounds`` rounds of
200 pings gathered on one ``AsyncController`` (after warm-up rounds). ``--by-package``: the calls
split by where the function lives (tornado, asyncio, jupyter_server, forkd_server...).

Usage: python3 bench/ping_calls.py [--rounds 10] [--by-package] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pstats
import re
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.api import serve_over, stop_and_clean
from forkd_server.client import AsyncController
from forkd_server.controller import Controller

ROUND = 200
ON, OFF = signal.SIGRTMIN + 3, signal.SIGRTMIN + 4  # jupyter_server takes SIGUSR1 for itself
# The forkd CLI with a profiler of the main (event-loop) thread that ON and OFF switch; OFF writes
# the counts to $FORKD_BENCH_PROFILE and then an empty "<path>.done".
PROFILED = [sys.executable, "-c", f"""
import cProfile, os, signal, sys
profile = cProfile.Profile()
def off(*_):
    profile.disable()
    profile.dump_stats(os.environ["FORKD_BENCH_PROFILE"])
    open(os.environ["FORKD_BENCH_PROFILE"] + ".done", "w").close()
signal.signal({int(ON)}, lambda *_: profile.enable())
signal.signal({int(OFF)}, off)
from forkd_server.cli import main
sys.exit(main())
"""]


async def rounds(url: str, token: str, sid: str, server, count: int) -> None:
    async with AsyncController(url, token) as actl:
        for _ in range(3):  # connections opened and every path warm, as in a long-lived client
            await asyncio.gather(*(actl.ping_sandbox(sid) for _ in range(ROUND)))
        server.send_signal(ON)
        await asyncio.sleep(0.2)  # (the loop idles meanwhile: its wake-ups are few)
        for _ in range(count):
            await asyncio.gather(*(actl.ping_sandbox(sid) for _ in range(ROUND)))
        server.send_signal(OFF)


def package(filename: str) -> str:
    """Where a profiled function lives: a package, a stdlib module, or ``builtins`` (C, ``~``)."""
    if filename == "~":
        return "builtins"
    for name in ("forkd_engine", "forkd_server"):
        if f"/{name}/" in filename:
            return name
    found = re.search(r"site-packages/([^/]+)", filename) or re.search(r"/python3\.\d+/([^/]+?)(?:\.py)?(?:/|$)", filename)
    return found[1] if found else filename


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--by-package", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    data = tempfile.mkdtemp(prefix="fkc")
    out = os.path.join(data, "loop.prof")
    os.environ["FORKD_BENCH_PROFILE"] = out  # the server inherits it
    ctl = Controller(data)
    server = None
    try:
        ctl.create_snapshot("bench", setup="x = 1")
        sid = ctl.spawn("bench", 1)[0]["id"]
        server, url, token, _client = serve_over(data, PROFILED)
        asyncio.run(rounds(url, token, sid, server, args.rounds))
        deadline = time.monotonic() + 60
        while not os.path.exists(out + ".done"):  # the server writes it on OFF
            if time.monotonic() > deadline:
                raise SystemExit("the server did not write its profile within 60 s")
            time.sleep(0.05)
        stats = pstats.Stats(out)
    finally:
        stop_and_clean(server, ctl, data)
    pings = args.rounds * ROUND
    result = {"pings": pings, "calls_per_ping": round(stats.total_calls / pings, 1)}
    if args.by_package:
        split = collections.Counter()
        for (filename, _line, _name), (_primitive, calls, *_rest) in stats.stats.items():
            split[package(filename)] += calls
        result["by_package"] = {name: round(calls / pings, 1) for name, calls in split.most_common()}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{pings} gathered pings: {result['calls_per_ping']:.0f} Python calls a ping on the server's loop")
        for name, calls in result.get("by_package", {}).items():
            if calls >= 1:
                print(f"  {calls:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
