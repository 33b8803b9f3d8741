"""Spawning sandboxes from a VM snapshot: each child is a QEMU started with ``-incoming`` on the
snapshot's device state and its ``memory.bin`` mapped privately (``share=off``), so every page it
does not write stays the page cache's shared page; a child with a disk gets its own qcow2 overlay on
the snapshot's frozen ``disk.raw``.

The engine's first request after every restore is ``restore`` (host entropy credited to the guest
CRNG and a forced reseed, wall clock stepped, Python RNGs reseeded, the child's identity); a child
that does not confirm it is killed, never handed out.

Its own room because a restore is its own problem: fanning out under a CPU budget, disk overlays,
children of a stopped source, and leaving nothing behind when any child fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..base import AgentUnreachable, ChildSpec, EngineError, Handle
from . import durable, snapshots, warm
from .channel import restore_request
from .qmp import QMP, QMPError

if TYPE_CHECKING:
    from .engine import VMEngine


def spawn(engine: "VMEngine", snapshot: Handle, children: list[ChildSpec]) -> list[Handle]:
    """Restore ``children`` from ``snapshot``; all of them confirmed, or none left running."""
    durable.ensure_files(engine, snapshot)  # after a reboot: memory.bin back into tmpfs from the store
    snapshots.check(engine, snapshot)
    overlays: dict[str, tuple[str, str]] = {}
    if snapshot.get("disk"):
        # One qcow2 overlay per child over the snapshot's frozen disk, made in parallel.
        procs = []
        for child in children:
            vm_dir = engine.qemu.vm_dir(child.id)
            shutil.rmtree(vm_dir, ignore_errors=True)
            os.makedirs(vm_dir, mode=0o700)
            overlays[child.id] = (os.path.join(vm_dir, "disk-0.qcow2"), "qcow2")
            procs.append(subprocess.Popen(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                                           pin_base_disk(snapshot["disk"], vm_dir),
                                           "-F", "raw", overlays[child.id][0]], stderr=subprocess.PIPE))
        failed = [p.stderr.read().decode(errors="replace") for p in procs if p.wait() != 0]
        for p in procs:
            p.stderr.close()
        if failed:
            for child in children:
                shutil.rmtree(engine.qemu.vm_dir(child.id), ignore_errors=True)
            raise EngineError(f"qemu-img create of a child's disk overlay failed: {failed[0].strip()}")
    started: list[Handle] = []      # every QEMU launched: all are killed if the spawn fails
    started_lock = threading.Lock()
    abandon = threading.Event()

    def restore(child: ChildSpec) -> Handle:
        if abandon.is_set():
            raise EngineError("spawn abandoned: another child failed")
        marks = {"start": time.perf_counter()}
        pooled = engine.warm.take(snapshot)  # started and loaded ahead, never run
        if pooled is not None:
            try:
                h = engine.warm.adopt(pooled, child.id)
                marks["warm"] = True
            except OSError:
                engine.warm.discard(pooled)
                pooled = None
        if pooled is None:
            h = engine.qemu.launch(child.id, snapshot["image"], snapshot["memory"], snapshot["mem_mib"],
                                   share=False, incoming_file=snapshot["devices"], disk=overlays.get(child.id),
                                   vm_dir_ready=child.id in overlays, defer=bool(snapshot.get("paused")),
                                   packages=snapshot.get("packages_image"))
        marks["launched"] = time.perf_counter()
        with started_lock:
            started.append(h)
        h["snapshot"] = snapshot["tag"]
        if snapshot.get("packages"):
            h["packages"] = snapshot["packages"]
        h["base_memory"] = snapshot["memory"]
        if child.memory_limit_mib:
            # The limit caps what this VM's QEMU process adds to what it shares with its
            # snapshot: guest pages it writes (copies of memory.bin), TCG's code, QEMU's heap.
            h["memory_limit_mib"] = child.memory_limit_mib
            try:
                h["cgroups"] = engine.cgroups.apply(child.id, h["pid"], child.memory_limit_mib, None)
            except OSError as exc:
                raise EngineError(str(exc)) from exc
        try:
            # Connect before the guest runs: it then sees its host connected throughout. A QEMU that
            # cannot restore (a torn device state) may be gone by the send already.
            ch = engine.channel(h)
            slot = ch.send(restore_request({"id": child.id, "role": "wake" if child.wake else "sandbox",
                                            "lineage": child.lineage}))
            if pooled is not None:
                if engine.restore_trace is not None:
                    marks["cpu_before_resume_ms"] = engine.qemu.cpu_ms(h["pid"])
                marks["resumed"] = time.perf_counter()
                warm.resume(pooled, engine.restore_timeout)
            elif "incoming_fd" in h:
                _incoming_and_cont(engine, h, h.pop("incoming_fd"))
            marks.setdefault("resumed", time.perf_counter())
            reply = ch.wait(slot, engine.restore_timeout)
            marks["replied"] = time.perf_counter()
        except (AgentUnreachable, EngineError, QMPError) as exc:
            raise EngineError(f"sandbox {child.id} did not come up: {exc}; {engine.qemu.log_tail(h)}") from exc
        if not reply.get("restored"):
            raise EngineError(f"sandbox {child.id} refused its restore (entropy/clock/identity), "
                              f"not serving it: {reply.get('error')}")
        if engine.restore_trace is not None:
            engine.restore_trace.append({"id": child.id, "pid": h["pid"], **marks})
        return h

    # A restore is CPU-bound (under TCG: translating the guest's first code afresh). At most one
    # per CPU at a time: more would only share the CPUs, and each guest would then see more of
    # its own timer interrupts while it waits, costing more CPU in all.
    workers = max(1, min(engine.restore_parallelism, len(children)))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vm-restore") if workers > 1 else None
    try:
        if pool is None:
            handles = [restore(child) for child in children]
        else:
            futures = [pool.submit(restore, child) for child in children]
            try:
                handles = [f.result() for f in futures]
            except BaseException:
                abandon.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        if not any(child.wake for child in children):  # a wake restores a sandbox's own state, once
            engine.warm.fill(snapshot)  # in the background: the next spawn of it finds QEMUs ready
        return handles
    except BaseException:
        for h in started:
            with contextlib.suppress(Exception):
                engine.kill(h)
        for child_id in overlays:  # children that never started keep no overlay behind
            shutil.rmtree(engine.qemu.vm_dir(child_id), ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=False)


def _incoming_and_cont(engine: "VMEngine", handle: Handle, fd: int) -> None:
    """Load device state saved from a stopped source (its children stay paused) and start it."""
    with QMP(handle["qmp"]) as qmp:
        qmp.execute("migrate-set-capabilities", {"capabilities": [{"capability": "events", "state": True}]})
        qmp.execute("migrate-incoming", {"uri": f"fd:{fd}"})
        while True:
            ev = qmp.wait_event("MIGRATION", timeout=engine.restore_timeout)
            status = ev.get("data", {}).get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                raise EngineError(f"loading the device state failed: {engine.qemu.log_tail(handle)}")
        qmp.execute("cont")


def pin_base_disk(disk: str, vm_dir: str) -> str:
    """The child's own name for its snapshot's frozen disk (a hard link in its directory): its
    overlay chain is opened by path again at every branch, and the snapshot may be deleted
    while the child lives. The snapshot's path where a link is impossible."""
    pinned = os.path.join(vm_dir, "disk-base.raw")
    try:
        os.link(disk, pinned)
    except OSError:
        return disk
    return pinned
