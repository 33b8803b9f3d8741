"""``forkd demo``: the whole idea in one minute, on real sandboxes, with measured figures.

A snapshot warms numpy and a 200 MiB array; 10 children fork from it; one child is branched while
it is busy computing; 3 grandchildren fork from the branch; the lineage tree and the timings are
printed; everything is cleaned up.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.tree import Tree

SETUP = """
import hashlib, numpy
data = numpy.ones({mib} * 2**20 // 8)
data_sha = hashlib.sha256(data.tobytes()).hexdigest()
steps = 0
"""
BUSY = """
open('/tmp/busy', 'w').close()
total = 0.0
for i in range(400):
    total += float(data[i::37].sum())
    steps += 1
round(total, 1)
"""


def lineage_tree(nodes: list[dict], title: str = "lineage") -> Tree:
    """A rich Tree of snapshots and sandboxes (as returned by ``Controller.tree``)."""
    by_parent: dict = {}
    ids = {n["id"] for n in nodes}
    for n in nodes:
        parent = n["parent"] if n["parent"] in ids else None
        by_parent.setdefault(parent, []).append(n)
    root = Tree(f"[bold]{title}")

    def label(n: dict) -> str:
        if n["kind"] == "snapshot":
            extra = f"  pause {n['pause_us'] / 1000:.2f} ms" if n.get("pause_us") is not None else ""
            colour = {"ready": "green", "writing": "yellow", "failed": "red", "lost": "red"}.get(n["status"], "white")
            return f"[bold cyan]snapshot[/] {n['id']}  [{colour}]{n['status']}[/]{extra}"
        return f"[magenta]sandbox[/] {n['id']}"

    def add(branch: Tree, parent) -> None:
        for n in sorted(by_parent.get(parent, []), key=lambda x: (x["kind"] != "snapshot", x["id"])):
            add(branch.add(label(n)), n["id"])

    add(root, None)
    return root


def run_demo(data_dir: str | None = None, children: int = 10, grandchildren: int = 3, mib: int = 200,
             console: Console | None = None) -> dict:
    from .controller import Controller

    console = console or Console()
    own_dir = tempfile.TemporaryDirectory(prefix="forkd-demo-") if data_dir is None else None
    ctl = Controller(own_dir.name if own_dir else data_dir)
    figures: dict = {}
    tag = f"demo-{int(time.time())}"
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            step = progress.add_task(f"snapshot {tag}: import numpy, fill a {mib} MiB array", total=1)
            t0 = time.perf_counter()
            ctl.create_snapshot(tag, setup=SETUP.format(mib=mib))
            figures["snapshot_ms"] = (time.perf_counter() - t0) * 1000
            progress.update(step, completed=1)

            step = progress.add_task(f"fork {children} children", total=children)
            t0 = time.perf_counter()
            kids = ctl.spawn(tag, children)
            for k in kids:
                ctl.ping(k["id"])
                progress.advance(step)
            figures["spawn_total_ms"] = (time.perf_counter() - t0) * 1000
            figures["spawn_ms_per_child"] = figures["spawn_total_ms"] / children

            step = progress.add_task("branch child 0 while it computes", total=1)
            source = kids[0]["id"]
            busy: dict = {}
            worker = threading.Thread(target=lambda: busy.update(ctl.run_code(source, BUSY)))
            worker.start()
            # Branch only once the computation is under way (it leaves a marker file first).
            while worker.is_alive() and not any(
                    e["name"] == "busy" for e in ctl.files(source, "list", "/tmp")["entries"]):
                pass
            # The cell does not go on in the branch (a fork keeps one thread): asked for with lossy,
            # the branch says so in its warnings; the VM engine would carry the running cell.
            branch = ctl.branch(source, f"{tag}-branch", mode="live", wait=False, lossy=True)
            warnings = branch.get("warnings") or []
            worker.join()
            branch = ctl.wait_snapshot(branch["tag"])
            figures["branch_pause_ms"] = branch["pause_us"] / 1000  # the precise figure
            figures["branch_warnings"] = warnings
            progress.update(step, completed=1)

            step = progress.add_task(f"fork {grandchildren} grandchildren from the branch", total=grandchildren)
            t0 = time.perf_counter()
            grand = ctl.spawn(branch["tag"], grandchildren)
            for g in grand:
                ctl.ping(g["id"])
                progress.advance(step)
            figures["grandchild_spawn_ms"] = (time.perf_counter() - t0) * 1000

        # Checks a user can read: the source finished unharmed, the state was carried down.
        source_result = (busy.get("result") or {}).get("text/plain")
        rerun = ctl.run_code(kids[1]["id"], BUSY)["result"]["text/plain"]
        sha = ctl.eval(kids[1]["id"], "data_sha")["result"]
        carried = all(ctl.eval(g["id"], "data_sha")["result"] == sha for g in grand)
        randoms = {ctl.eval(k["id"], "numpy.random.random()")["result"] for k in kids}
        mem = [ctl.memory(k["id"]) for k in kids[1:]]
        figures.update({
            "source_result_unchanged": source_result == rerun,
            "state_carried_to_grandchildren": carried,
            "children_random_streams_distinct": len(randoms) == len(kids),
            "uss_mib_per_idle_child": statistics.median(m["uss_kib"] for m in mem) / 1024,
            "pss_mib_per_idle_child": statistics.median(m["pss_kib"] for m in mem) / 1024,
        })

        console.print(lineage_tree(ctl.tree(), title=f"lineage of {tag}"))
        for warning in warnings:
            console.print(f"[yellow]branch warning:[/yellow] {warning}")
        table = Table(title="measured on this machine")
        table.add_column("figure")
        table.add_column("value", justify="right")
        rows = [
            ("snapshot (numpy + array) ready", f"{figures['snapshot_ms']:.0f} ms"),
            (f"fork {children} children, all answering ping", f"{figures['spawn_total_ms']:.1f} ms"),
            ("  per child", f"{figures['spawn_ms_per_child']:.2f} ms"),
            ("branch pause of a busy child", f"{figures['branch_pause_ms']:.2f} ms"),
            (f"fork {grandchildren} grandchildren", f"{figures['grandchild_spawn_ms']:.1f} ms"),
            ("private memory (USS) per idle child", f"{figures['uss_mib_per_idle_child']:.2f} MiB"),
            ("proportional memory (PSS) per idle child", f"{figures['pss_mib_per_idle_child']:.2f} MiB"),
            ("busy source's result unchanged by the branch", str(figures["source_result_unchanged"])),
            ("200 MiB state carried to grandchildren", str(figures["state_carried_to_grandchildren"])),
            ("every child draws its own random numbers", str(figures["children_random_streams_distinct"])),
        ]
        for name, value in rows:
            table.add_row(name, value)
        console.print(table)
    finally:
        with console.status("cleaning up"):
            for sb in ctl.list_sandboxes():
                ctl.kill_sandbox(sb["id"])
            for snap in ctl.list_snapshots():
                ctl.delete_snapshot(snap["tag"])
            ctl.close()
            if own_dir:
                own_dir.cleanup()
        console.print("cleaned up: no sandbox or snapshot left running")
    return figures
