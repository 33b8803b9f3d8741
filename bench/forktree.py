"""A fork tree against the same steps by hand, in one run (process engine, real sandboxes).

    python3 bench/forktree.py            # a table
    python3 bench/forktree.py --json     # one JSON object

Both sides start from one running sandbox holding numpy and a 64 MiB array, through the controller
(no HTTP), interleaved round by round (``--rounds``), medians and the ratio of the medians:

- ``fork``: ``Controller.fork(sb, n)`` until every child answers a ping, against the same by hand:
  ``branch(sb, mode="live")``, then ``spawn(tag, n)``, then the pings.
- ``promote``: ``Controller.promote(winner)`` (the siblings killed, the tree's snapshot released),
  against killing the siblings one by one and deleting the snapshot.

The load average is printed with the figures: on a shared machine, only ratios of one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from forkd_server.controller import Controller  # noqa: E402

SETUP = "import numpy\ndata = numpy.ones(64 * 2**20 // 8)\n"


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def answered(ctl: Controller, kids: list[dict]) -> list[str]:
    ids = [k["id"] for k in kids]
    for sid in ids:
        ctl.ping(sid)
    return ids


def tree_side(ctl: Controller, source: str, n: int) -> dict:
    tree_ms, tree = timed(lambda: ctl.fork(source, n))
    ping_ms, ids = timed(lambda: answered(ctl, tree["sandboxes"]))
    promote_ms, _ = timed(lambda: ctl.promote(ids[0]))
    ctl.kill_sandbox(ids[0])
    return {"fork_ms": tree_ms + ping_ms, "promote_ms": promote_ms}


def hand_side(ctl: Controller, source: str, n: int) -> dict:
    def by_hand() -> tuple[str, list[str]]:
        snap = ctl.branch(source, mode="live")
        return snap["tag"], answered(ctl, ctl.spawn(snap["tag"], n))

    hand_ms, (tag, ids) = timed(by_hand)

    def drop() -> None:
        for sid in ids[1:]:
            ctl.kill_sandbox(sid)
        ctl.delete_snapshot(tag)

    drop_ms, _ = timed(drop)
    ctl.kill_sandbox(ids[0])
    return {"by_hand_ms": hand_ms, "drop_by_hand_ms": drop_ms}


def round_(ctl: Controller, source: str, n: int, i: int) -> dict:
    """One pair, the side that goes first alternating round by round."""
    sides = [tree_side, hand_side] if i % 2 == 0 else [hand_side, tree_side]
    out: dict = {}
    for side in sides:
        out.update(side(ctl, source, n))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("-n", type=int, default=5, help="children per tree (default 5)")
    args = parser.parse_args()
    out: dict = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release}, "n": args.n,
                 "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="fkt") as data_dir:
        ctl = Controller(data_dir)
        try:
            ctl.create_snapshot("forktree64", setup=SETUP)
            source = ctl.spawn("forktree64", 1)[0]["id"]
            round_(ctl, source, args.n, 0)  # warm
            rounds = [round_(ctl, source, args.n, i) for i in range(args.rounds)]
            ctl.kill_sandbox(source)
            ctl.delete_snapshot("forktree64")
        finally:
            ctl.close()
    med = {k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0]}
    out.update(rounds=args.rounds, median_ms=med,
               fork_vs_by_hand=round(med["fork_ms"] / med["by_hand_ms"], 3),
               promote_vs_by_hand=round(med["promote_ms"] / med["drop_by_hand_ms"], 3),
               load_after=os.getloadavg())
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for key, value in out.items():
            print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
