"""What a dead writer leaves in the VM engine, found and repaired.

A live branch streams the source's RAM while userfaultfd write-protects it (QEMU's
``background-snapshot``). If the stream's reader dies (the server was killed, or its thread
failed), QEMU 7.2 fails the migration but never lifts the protect: the first vCPU that writes a
protected page waits for good, holding the big lock that QEMU's clean-up and every QMP command
need. The VM is frozen while its process lives. ``thaw`` lifts the protect from outside
(``memory.lift_write_protect``) and resumes a VM left stopped; ``after_failed_live_branch`` does
that when a live branch's writer fails in the server, and kills the source, saying why, when it
still does not answer. ``sweep`` removes what no record owns: RAM files (on tmpfs, host memory),
snapshot directories, and VM directories whose QEMU nobody records.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import TYPE_CHECKING

from ..base import AgentUnreachable, Handle
from . import memory as vmem
from .qmp import QMP, QMPError

if TYPE_CHECKING:
    from .engine import VMEngine

QMP_TIMEOUT = 5.0
PING_TIMEOUT = 5.0
WRITER_GONE_TIMEOUT = 10.0  # how long QEMU's bg_snapshot thread may take to notice a closed stream


def _threads(pid: int) -> list[str]:
    names = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
    return names


def thaw(handle: Handle) -> list[str]:
    """Lift a write-protect no live branch owns any more and resume a VM left stopped; returns what
    was done, one line each (empty when the VM was fine). Call only when no branch of this VM runs."""
    done = []
    pid = handle["pid"]
    if vmem.userfaultfds(pid):
        try:
            start, _pgoff, _path = vmem.find_ram_mapping(pid, handle["mem_mib"] << 20)
            if vmem.lift_write_protect(pid, start, handle["mem_mib"] << 20):
                done.append("lifted the write-protect of a live branch whose writer died "
                            "(its vCPUs were waiting on it)")
        except OSError as exc:  # it may have exited meanwhile: whether it answers decides (the probe)
            done.append(f"could not lift a write-protect ({exc})")
    try:
        with QMP(handle["qmp"], timeout=QMP_TIMEOUT) as qmp:
            if qmp.execute("query-migrate").get("status") in ("active", "setup", "device", "pre-switchover"):
                qmp.execute("migrate_cancel")
                done.append("cancelled a migration nobody reads")
            with contextlib.suppress(QMPError):
                qmp.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "background-snapshot", "state": False}]})
            status = qmp.execute("query-status").get("status")
            if status in ("paused", "postmigrate", "finish-migrate"):
                qmp.execute("cont")
                done.append(f"resumed it: a branch left it stopped ({status})")
    except QMPError as exc:
        done.append(f"its monitor does not answer ({exc})")
    return done


def after_failed_live_branch(engine: "VMEngine", handle: Handle, why: str) -> str:
    """The live branch of ``handle`` failed with ``why`` and its stream is closed: make sure the source
    runs on. Returns the sentence the branch's error carries about the source."""
    pid = handle["pid"]
    if not engine.alive(handle):
        return f"the source {handle['name']} is gone too (its QEMU {pid} exited)"
    deadline = time.monotonic() + WRITER_GONE_TIMEOUT
    while "bg_snapshot" in _threads(pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # QEMU's snapshot thread ends at its next write to the closed stream
    try:
        done = thaw(handle)
        engine.call(handle, {"action": "ping"}, timeout=PING_TIMEOUT)
    except (AgentUnreachable, OSError, QMPError) as exc:
        engine.kill(handle)
        return (f"the source {handle['name']} did not run on after the failed live branch ({exc}) and was "
                f"killed")
    return f"the source {handle['name']} runs on" + (f" ({'; '.join(done)})" if done else "")


def sweep(engine: "VMEngine", known: list[Handle]) -> list[str]:
    """Remove RAM files, snapshot directories and VM directories that no handle in ``known`` owns
    (ending a QEMU nobody records). Only what is older than the engine: anything this engine is
    writing (a snapshot, a spawn not yet recorded) was made since it started."""
    found = []
    owned = {os.path.dirname(h[k]) for h in known for k in ("memory", "base_memory") if h.get(k)}
    owned |= {h["dir"] for h in known if h.get("dir")}
    for root, what in ((engine.mem_root, "RAM files"), (engine.snap_dir, "snapshot files"),
                       (engine.run_dir, "VM directory")):
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(root):
                if entry.path in owned or not entry.is_dir(follow_symlinks=False) \
                        or entry.stat(follow_symlinks=False).st_mtime >= engine.started:
                    continue
                pid = engine.qemu.stop_recorded(entry.path)
                ended = f", ending its QEMU {pid}" if pid else ""
                size = _disk_usage(entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)
                found.append(f"vm engine: removed {what} no record owns: {entry.path} ({size >> 20} MiB{ended})")
    # QEMUs of this engine whose directory is gone (or was never recorded): found by where they run.
    pids = {h["pid"] for h in known if h.get("kind") == "vm"}
    for pid, start, cwd in engine.qemu.running_here():
        if pid not in pids and start is not None and start < engine.started_ticks:
            engine.qemu.stop(pid, start)
            found.append(f"vm engine: ended QEMU {pid} that no record names (it ran in {cwd})")
    return found


def _disk_usage(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total
