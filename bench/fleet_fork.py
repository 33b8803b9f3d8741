"""A fork tree through ``forkd router``: on the source's host, or across hosts when it lacks room.

Two VM-engine ``forkd serve`` hosts capped at 4 sandboxes each, sharing moto's S3 on loopback as
the store, and a router (tests/fleet/fleet.py). A VM snapshot (``--mem`` MiB of guest RAM) is made
through the router on one host (the holder); a sandbox of it (the source) runs ``x = 7``. Each
round, in alternating order:

* ``on_host``: ``fork(source, n=3)``: the holder has room (1 + 3 of 4), so the host makes the tree.
* ``across``: two more sandboxes of the snapshot, spawned on the holder directly, fill it to 3 of 4; then
  ``fork(source, n=3)`` spans hosts: the router branches the source on the holder, one child there,
  two on the other host, which pulls the branch from the store after the holder pushed it.

Timed: the fork call until its reply (every child answers), then ``promote`` of the last child (its
siblings killed on their hosts, the tree's snapshot released everywhere); each child's ``eval("x")``
is checked to be 7. Reported: each round, and the medians. Round 1's ``across`` pulls the whole
branch; later ones find most of its chunks in the other host's cache (the branches share pages).

Usage: python3 bench/fleet_fork.py [--rounds 3] [--mem 256] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forkd_server.client import Controller  # noqa: E402
from tests.fleet.fleet import fleet  # noqa: E402
from tests.store.s3 import S3_ENV, moto_s3  # noqa: E402


def one(api: Controller, holder: Controller, source: str, fillers: int) -> dict:
    extra = [k["id"] for k in holder.spawn_sandboxes("fkbase", fillers)] if fillers else []  # on the holder itself
    t0 = time.perf_counter()
    tree = api.fork_sandbox(source, 3)
    fork_ms = (time.perf_counter() - t0) * 1000
    kids = tree["sandboxes"]
    assert [api.eval_code(k["id"], "x")["result"] for k in kids] == ["7"] * 3
    t0 = time.perf_counter()
    kept = api.promote_sandbox(kids[-1]["id"])
    promote_ms = (time.perf_counter() - t0) * 1000
    assert len(kept["killed"]) == 2 and kept["released"] == [tree["snapshot"]["tag"]], kept
    for sid in [kids[-1]["id"], *extra]:
        api.kill_sandbox(sid)
    return {"fork_ms": round(fork_ms), "promote_ms": round(promote_ms),
            "hosts": len({k["host"] for k in kids})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rounds: dict[str, list[dict]] = {"on_host": [], "across": []}
    with contextlib.redirect_stdout(sys.stderr), moto_s3() as (endpoint, _log):
        env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        os.environ.update(env)  # the hosts inherit it
        host_args = ["--store", "s3://forkd/bench-fork", "--ForkdApp.max_sandboxes=4"]
        with fleet(2, host_args=[host_args, host_args]) as (router, hosts):
            api = Controller(router.url, router.token, timeout=900)
            made = api.create_snapshot("fkbase", engine="vm", mem_size_mib=args.mem, setup="x = 41")
            holder = next(Controller(h.url, h.token, timeout=900) for h in hosts if h.url == made["host"])
            source = api.spawn_sandboxes("fkbase")[0]["id"]
            api.run_code(source, "x = 7")
            for r in range(args.rounds):
                for arm in (("on_host", "across") if r % 2 == 0 else ("across", "on_host")):
                    got = one(api, holder, source, 2 if arm == "across" else 0)
                    assert got["hosts"] == (2 if arm == "across" else 1), got
                    rounds[arm].append(got)
                    print(f"round {r + 1} {arm}: {got}", file=sys.stderr)
            api.kill_sandbox(source)
    out = {arm: {"rounds": rs, "fork_ms_median": statistics.median(x["fork_ms"] for x in rs),
                 "promote_ms_median": statistics.median(x["promote_ms"] for x in rs)}
           for arm, rs in rounds.items()}
    out["mem_mib"] = args.mem
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
