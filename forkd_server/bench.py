"""``forkd bench``: a latency probe through a running server, like forkd's (one sample of each step).

Creates a throwaway snapshot, then measures: spawn n=1, an exec round trip, a ping, a full and a
live branch (with the source's pause), a fan-out of n, and the cleanup. Times are wall-clock round
trips seen by the client, so they include HTTP.
"""

from __future__ import annotations

import time


def run_bench(ctl, n: int = 5, show: bool = True) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    tag = f"bench-{int(time.time())}-{time.monotonic_ns() % 10000:04d}"
    figures: dict = {"n": n}
    made: list[str] = []
    snaps: list[str] = []

    def timed(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        figures[name] = round((time.perf_counter() - t0) * 1000, 3)
        return out

    try:
        with console.status("bench: snapshot", spinner="dots") if show else _Null():
            timed("snapshot_ms", ctl.create_snapshot, tag, setup="import json, random\nstate = list(range(1000))")
            snaps.append(tag)
            one = timed("spawn_n1_ms", ctl.spawn_sandboxes, tag, 1)
            made += [s["id"] for s in one]
            sid = one[0]["id"]
            timed("ping_ms", ctl.ping_sandbox, sid)
            timed("exec_ms", ctl.exec_command, sid, ["/bin/true"])
            timed("eval_ms", ctl.eval_code, sid, "len(state)")
            full = timed("branch_full_ms", ctl.branch_sandbox, sid, f"{tag}-full")
            snaps.append(full["tag"])
            figures["branch_full_pause_ms"] = full.get("pause_ms")
            live = timed("branch_live_nowait_ms", ctl.branch_sandbox, sid, f"{tag}-live", mode="live", wait=False)
            snaps.append(live["tag"])
            figures["branch_live_pause_ms"] = live.get("pause_ms")
            ctl.wait_snapshot(live["tag"], timeout=60)
            fan = timed("fanout_ms", ctl.spawn_sandboxes, tag, n)
            made += [s["id"] for s in fan]
            figures["fanout_ms_per_child"] = round(figures["fanout_ms"] / n, 3)
    finally:
        t0 = time.perf_counter()
        for sid in made:
            ctl.kill_sandbox(sid)
        for snap in reversed(snaps):
            ctl.delete_snapshot(snap)
        figures["cleanup_ms"] = round((time.perf_counter() - t0) * 1000, 3)
    if show:
        table = Table(title=f"forkd bench via {ctl.base_url} (one sample each, client round trips)",
                      title_justify="left")
        table.add_column("step")
        table.add_column("ms", justify="right")
        for key, value in figures.items():
            if key != "n" and value is not None:
                table.add_row(key.removesuffix("_ms").replace("_", " "), f"{value:.2f}")
        Console().print(table)
    return figures


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
