"""Benchmark of the forkd kernel ("Python 3 (forkd)") against a plain ipykernel, on this machine.

    python3 bench/kernel.py            # a table
    python3 bench/kernel.py --json     # one JSON object

Figures (one run; medians, and ratios of figures taken in that run):
- execute_p50_ms: a trivial cell (``x = 1``) from execute_request to execute_reply, for the forkd
  kernel and for ipykernel, interleaved so load falls on both alike; ``overhead_ms`` their difference.
- branch_live_1gib: ``%forkd branch --live`` of a notebook holding 1 GiB (numpy), as the cell's
  round trip (``call_ms``) and the source's freeze (``pause_ms``), medians of 5, in three cases:
  ``right_after_rewrite`` (a cell rewrote the whole GiB, shared with the previous branch, just
  before), ``after_idle`` (the notebook idled until its memory settled; ``idle_s`` is how long)
  and ``new_array_right_after_rewrite`` (the same with a GiB allocated a moment before, which has
  not moved into hugetlb pages yet). ``settle_s``: how long the notebook idled after allocating
  the GiB until it had moved (docs/design/kernel.md, "Memory and the live branch").
- first_write_1gib: the first full rewrite of a 1 GiB array (``big += 1.0``) right after ``%forkd
  branch --live`` (copy-on-write copies each of its pages once), the same rewrite with no branch, and
  in a plain ipykernel; in each round the three run back to back (paired) after the notebook idled
  ``--idle`` s, as a user between cells, and its memory settled; medians of ``--first-write-rounds``.
  ``wall_s`` is timed in the cell, ``cpu_s`` is the main thread's CPU time in it (on this VM it
  includes the host faulting in memory it took back, and load barely moves it), ``call_s`` the cell's
  round trip. ``memcpy_s``: ``np.copyto`` of 1 GiB between resident arrays in the plain kernel, the
  floor of any copy. ``reserve_free_mib``: the host's free huge pages at the branch
  (process/reserve.py), into which the copies go (docs/design/kernel.md, "Memory and the live branch").
- fork5_ms: ``kids = %forkd fork -n 5`` until five sandboxes answer a ping.
- checkout_ms: ``%forkd checkout kids[0]`` plus the first cell in the new HEAD.
- interrupt: from the interrupt request (``KernelManager.interrupt_kernel``, as the stop button)
  to the ``execute_reply`` of a cell stopped by it: ``time.sleep(60)`` in HEAD, and ``%%forkd run``
  of a ``time.sleep(60)`` in five sandboxes at once (once every one of them has started it).
- kishu (``bench/kishu_compare.py``): Kishu's checkpoint and checkout of the same 1 GiB state in a
  plain ipykernel, and their ratios to forkd's figures of this run: its checkpoint after a rewrite
  to ``%forkd branch --live`` right after a rewrite, its checkout to ``checkout_ms``. When Kishu
  cannot run here, ``kishu.error`` says why (and the bench prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jupyter_client.manager import start_new_kernel  # noqa: E402

from tests.kernel.conftest import ServerForKernels  # noqa: E402 - a forkd serve the kernels find

GIB_SETUP = "import numpy as np\nbig = np.ones(2**27)  # 1 GiB of float64\n"


def execute(kc, code: str, timeout: float = 300) -> tuple[float, dict, list[dict]]:
    """(round trip in ms, reply content, iopub messages) of one cell."""
    messages: list[dict] = []
    t0 = time.perf_counter()
    reply = kc.execute_interactive(code, output_hook=messages.append, timeout=timeout)
    ms = (time.perf_counter() - t0) * 1000
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r} failed: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
    return ms, reply["content"], messages


def result_text(messages: list[dict]) -> str:
    for m in messages:
        if m["msg_type"] == "execute_result":
            return m["content"]["data"]["text/plain"]
    return ""


def bench_execute(forkd_kc, plain_kc, rounds: int) -> dict:
    for kc in (forkd_kc, plain_kc):
        for _ in range(20):
            execute(kc, "x = 1")  # warm both paths
    forkd, plain = [], []
    for _ in range(rounds):
        forkd.append(execute(forkd_kc, "x = 1")[0])
        plain.append(execute(plain_kc, "x = 1")[0])
    f, p = statistics.median(forkd), statistics.median(plain)
    return {"forkd_p50_ms": round(f, 3), "ipykernel_p50_ms": round(p, 3), "overhead_ms": round(f - p, 3),
            "rounds": rounds}


def memory_mib(kc) -> dict:
    """The notebook sandbox's memory: ``split`` is private memory in 4 KiB pages (what a fork
    copies entry by entry), ``hugetlb`` what its arrays hold in hugetlb pages (never split)."""
    _, _, msgs = execute(kc, "import forkd_engine.process.compactor as _c\n"
                             "(_c.split_anonymous_kib() / 1024, _c.hugetlb_kib() / 1024)")
    split, huge = (float(x) for x in result_text(msgs).strip("()").split(","))
    return {"split": round(split, 1), "hugetlb": round(huge, 1)}


def settle(kc, name: str, limit_s: float = 300) -> float:
    """Idle (a look every 0.2 s, as a user between cells) until the array ``name`` has moved into
    hugetlb pages where the host has them, else until the compaction has re-formed huge pages;
    returns the seconds it took."""
    t0 = time.perf_counter()
    _, _, msgs = execute(kc, f"{name}.nbytes / 2**20")
    want = float(result_text(msgs)) - 4  # all but its unaligned ends
    while time.perf_counter() - t0 < limit_s:
        mem = memory_mib(kc)
        if mem["hugetlb"] >= want or (mem["hugetlb"] == 0 and mem["split"] < 64 and time.perf_counter() - t0 > 10):
            break
        time.sleep(0.2)
    return round(time.perf_counter() - t0, 2)


def branch_once(kc, ctl) -> dict:
    ms, _, msgs = execute(kc, "%forkd branch --live")
    text = result_text(msgs)
    tag = text.split("'")[1] if "'" in text else text
    info = {"call_ms": round(ms, 2), "pause_ms": ctl.snapshot_info(tag).get("pause_ms")}
    ctl.delete_snapshot(tag)  # it holds the GiB as it was: not kept past its figure
    return info


def summary(rounds: list[dict]) -> dict:
    return {"call_ms": round(statistics.median(r["call_ms"] for r in rounds), 1),
            "pause_ms": statistics.median(r["pause_ms"] for r in rounds),
            "rounds": rounds}


def bench_branch(kc, ctl, rounds: int = 5) -> dict:
    """Three cases, ``rounds`` branches each: right after a cell rewrote the GiB (shared with the
    previous branch, so copy-on-write touched all of it), after an idle pause, and right after a
    rewrite of an array allocated a moment before (not yet moved into hugetlb pages)."""
    execute(kc, GIB_SETUP)
    out = {"settle_s": settle(kc, "big")}  # how long the notebook idles before big has moved
    out["memory_mib_before"] = memory_mib(kc)
    execute(kc, "%forkd branch --live")   # the GiB is now shared with a snapshot
    after = []
    for _ in range(rounds):
        execute(kc, "big += 1.0")         # ...so this rewrite copies all of it
        after.append(branch_once(kc, ctl))
    out["memory_mib_after_rewrite"] = memory_mib(kc)
    out["right_after_rewrite"] = summary(after)
    idle = []
    for _ in range(rounds):
        execute(kc, "big += 1.0")
        waited = settle(kc, "big")
        idle.append({**branch_once(kc, ctl), "idle_s": waited})
    out["after_idle"] = summary(idle)
    fresh = []
    for _ in range(min(rounds, 3)):
        execute(kc, "fresh = np.ones(2**27)")
        execute(kc, "%forkd branch --live")
        execute(kc, "fresh += 1.0")
        fresh.append(branch_once(kc, ctl))
        execute(kc, "del fresh")
    out["new_array_right_after_rewrite"] = summary(fresh)
    return out


REWRITE = ("import time as _t\n_c, _w = _t.thread_time(), _t.perf_counter()\nbig += 1.0\n"
           "(_t.perf_counter() - _w, _t.thread_time() - _c)")


def rewrite(kc) -> dict:
    """``big += 1.0`` in one cell: wall and CPU time inside the cell, and the cell's round trip."""
    ms, _, msgs = execute(kc, REWRITE)
    wall, cpu = (float(x) for x in result_text(msgs).strip("()").split(","))
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "call_s": round(ms / 1000, 3)}


def free_huge_pages_mib() -> float:
    """The host's free huge pages that no mapping has reserved (the bench runs on the server's host)."""
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip()}
    return (info["HugePages_Free"] - info["HugePages_Rsvd"]) * info["Hugepagesize"] / 1024


def reserve_ready(mib: float, limit_s: float = 120) -> float:
    """Seconds until the host's warm reserve holds ``mib``, or all it may (process/reserve.py); at
    most ``limit_s``."""
    from forkd_engine.process.reserve import ceiling_pages  # noqa: PLC0415 - the server's setting, same host

    mib = min(mib, ceiling_pages() * 2)
    t0 = time.perf_counter()
    while free_huge_pages_mib() < mib and time.perf_counter() - t0 < limit_s:
        time.sleep(0.2)
    return round(time.perf_counter() - t0, 2)


def medians(rounds: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rounds), 3) for k in ("wall_s", "cpu_s", "call_s")}


def bench_first_write(fkc, pkc, ctl, rounds: int, idle_s: float) -> dict:
    """The first full rewrite of 1 GiB right after a live branch, with no branch, in ipykernel: paired."""
    execute(fkc, GIB_SETUP)
    execute(pkc, GIB_SETUP + "dst = np.zeros_like(big)\n")
    out: dict = {"settle_s": settle(fkc, "big"), "idle_s": idle_s}
    runs = []
    for _ in range(rounds):
        time.sleep(idle_s)  # the user between cells
        waited = reserve_ready(1024)
        free = free_huge_pages_mib()
        _, _, msgs = execute(fkc, "%forkd branch --live")
        text = result_text(msgs)
        after = rewrite(fkc)  # right after: the next cell
        ctl.delete_snapshot(text.split("'")[1] if "'" in text else text)
        _, _, msgs = execute(pkc, "import time as _t\n_w = _t.perf_counter()\nnp.copyto(dst, big)\n"
                                  "_t.perf_counter() - _w")
        runs.append({"after_live_branch": after, "no_branch": rewrite(fkc), "ipykernel": rewrite(pkc),
                     "memcpy_s": round(float(result_text(msgs)), 3), "reserve_free_mib": free,
                     "reserve_wait_s": waited})
    for case in ("after_live_branch", "no_branch", "ipykernel"):
        out[case] = medians([r[case] for r in runs])
    out["memcpy_s"] = round(statistics.median(r["memcpy_s"] for r in runs), 3)
    out["reserve_free_mib"] = statistics.median(r["reserve_free_mib"] for r in runs)
    out["rounds"] = runs
    return out


def first_write_lines(fw: dict) -> list[str]:
    def case(name: str) -> str:
        c = fw[name]
        return f"{c['wall_s']:.3f} s (CPU {c['cpu_s']:.3f} s, cell {c['call_s']:.3f} s)"
    return [f"first rewrite of 1 GiB ({len(fw['rounds'])} paired rounds, medians):",
            f"  right after %forkd branch --live  {case('after_live_branch')}",
            f"  forkd kernel, no branch           {case('no_branch')}",
            f"  plain ipykernel                   {case('ipykernel')}",
            f"  memcpy of 1 GiB (the floor)       {fw['memcpy_s']:.3f} s",
            f"  warm free huge pages at the branch: {fw['reserve_free_mib']:.0f} MiB"]


def fork_five(kc, ctl) -> tuple[float, list[str]]:
    """ms from ``kids = %forkd fork -n 5`` until each of the five answers a ping, and their ids."""
    before = {s["id"] for s in ctl.list_sandboxes()}
    t0 = time.perf_counter()
    execute(kc, "kids = %forkd fork -n 5")
    kids = [s["id"] for s in ctl.list_sandboxes() if s["id"] not in before]
    for sb in kids:
        ctl.ping_sandbox(sb)
    ms = (time.perf_counter() - t0) * 1000
    assert len(kids) == 5, kids
    return ms, kids


def bench_fork_checkout(kc, ctl) -> dict:
    fork5, _ = fork_five(kc, ctl)
    t0 = time.perf_counter()
    execute(kc, "%forkd checkout kids[0]")
    execute(kc, "x = 2")
    checkout = (time.perf_counter() - t0) * 1000
    return {"fork5_ms": round(fork5, 1), "checkout_ms": round(checkout, 1)}


def _interrupt_once(km, kc, code: str, started, timeout: float = 120) -> float:
    """ms from the interrupt request to the execute_reply of ``code``, interrupted once ``started``
    (a predicate over iopub messages) says it is running."""
    msg_id = kc.execute(code)
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id and started(msg):
            break
    t0 = time.perf_counter()
    km.interrupt_kernel()
    while True:
        reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    ms = (time.perf_counter() - t0) * 1000
    if reply["content"]["status"] != "error":
        raise RuntimeError(f"the interrupted cell {code!r} ended {reply['content']['status']!r}")
    while True:  # its output until idle, so the next cell starts clean
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return ms


def _printed(text: str, times: int = 1):
    def started(msg: dict) -> bool:
        content = msg["content"]
        shown = content.get("text") or (content.get("data") or {}).get("text/plain") or ""
        return shown.count(text) >= times
    return started


def bench_interrupt(km, kc, rounds: int = 5) -> dict:
    execute(kc, "import time")
    sleep = [_interrupt_once(km, kc, "print('sleeping', flush=True)\ntime.sleep(60)", _printed("sleeping"))
             for _ in range(rounds)]
    execute(kc, "sleepers = %forkd fork -n 5")
    run = [_interrupt_once(km, kc, "%%forkd run sleepers\nprint('sleeping', flush=True)\ntime.sleep(60)",
                           _printed("sleeping", 5)) for _ in range(rounds)]
    execute(kc, "%forkd kill {' '.join(s.id for s in sleepers)}")
    return {"sleep_p50_ms": round(statistics.median(sleep), 1), "sleep_max_ms": round(max(sleep), 1),
            "forkd_run_5_p50_ms": round(statistics.median(run), 1), "forkd_run_5_max_ms": round(max(run), 1),
            "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--no-kishu", action="store_true")
    parser.add_argument("--first-write-rounds", type=int, default=7)
    parser.add_argument("--idle", type=float, default=5.0, help="s the notebook idles before each branch "
                                                                  "of the first-write figure")
    parser.add_argument("--only", choices=["first_write"], help="run only this figure")
    args = parser.parse_args()
    server = ServerForKernels()
    from forkd_server.client import Controller
    ctl = Controller(server.url, server.token)
    results: dict = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]}}
    try:
        fkm, fkc = start_new_kernel(kernel_name="forkd-python")
        pkm, pkc = start_new_kernel(kernel_name="python3")
        try:
            if not args.only:
                results["execute"] = bench_execute(fkc, pkc, args.rounds)
                results["branch_live_1gib"] = bench_branch(fkc, ctl)
            results["first_write_1gib"] = bench_first_write(fkc, pkc, ctl, args.first_write_rounds, args.idle)
            if not args.only:
                results.update(bench_fork_checkout(fkc, ctl))
                results["interrupt"] = bench_interrupt(fkm, fkc)
        finally:
            for km, kc in ((fkm, fkc), (pkm, pkc)):
                kc.stop_channels()
                km.shutdown_kernel(now=True)
        if not args.no_kishu and not args.only:
            try:
                from kishu_compare import kishu_figures  # noqa: PLC0415 - optional, heavy
                kishu = kishu_figures(gib=1)
            except Exception as exc:  # noqa: BLE001 - report why, keep our own figures
                kishu = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"bench/kernel.py: Kishu could not run here: {kishu['error']}", file=sys.stderr)
            results["kishu"] = kishu
            branch = results["branch_live_1gib"]["right_after_rewrite"]["call_ms"]  # Kishu's case too
            if "checkpoint_ms" in kishu:
                kishu["checkpoint_over_forkd_branch"] = round(kishu["checkpoint_ms"] / branch, 1)
                kishu["checkout_over_forkd_checkout"] = round(kishu["checkout_ms"] / results["checkout_ms"], 1)
    finally:
        server.stop()
    results["machine"]["load_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(json.dumps({k: v for k, v in results.items() if k != "first_write_1gib"}, indent=1))
        print("\n".join(first_write_lines(results["first_write_1gib"])))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
