"""QEMUs started ahead of a spawn: each waits for the next child of one snapshot, its device state
already loaded and its vCPUs never run.

A restore costs QEMU's start (its process, machine and devices: ~25 ms of CPU here) and the load of
the snapshot's device state before the guest runs one instruction; neither depends on which child
the VM becomes. ``WarmPool`` does both ahead, off the spawn's path: after a snapshot's second and
every later spawn it starts, in the background, up to ``size`` QEMUs (one per CPU) with that snapshot's own command
line plus ``-S`` and ``-incoming defer``, connects their agent port (the guest then never sees
its host disconnected), and loads the device state over QMP. Such a VM is paused and has run
nothing: its RAM is the snapshot's file mapped privately, untouched. A spawn ``take``s one, sends
the restore line (entropy, clock, identity: all fresh, made at that moment) and ``cont``; only the
guest's own run to its reply is left on the path. Of a *quiet* snapshot (nothing of the user's
runs in its guest), the pooled guest also runs ahead once until its agent answers a ping and is
paused again (``prerun``): the child's run to its reply then finds most of its code translated.

A pooled QEMU serves only a snapshot whose command line and files are exactly those it was started
with (``key``: the RAM and device-state files by inode, size and mtime, the RAM size, the packages
disk); anything else is a cold restore. A snapshot with a data disk is never pooled: each child's
disk is an overlay of its own, named on the command line. Pooled QEMUs are killed when their
snapshot is deleted or its RAM file released, when the pool is full of another snapshot's, and on
``close`` (the engine's); a server killed outright leaves them to the next start's sweep
(``recovery.sweep``: a VM directory no record owns).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING

from ..base import AgentUnreachable, EngineError, Handle
from .channel import AgentChannel
from .qmp import QMP, QMPError

if TYPE_CHECKING:
    from .engine import VMEngine

LOAD_TIMEOUT = 30.0
KEEP_SNAPSHOTS = 2  # snapshots whose pooled QEMUs are kept at once (the most recently spawned)


def key(snapshot: Handle) -> tuple | None:
    """What a pooled QEMU must match to serve ``snapshot``; None: never pooled (a data disk)."""
    if snapshot.get("disk"):
        return None
    files = []
    for name in ("memory", "devices", "packages_image"):
        path = snapshot.get(name)
        if path is None:
            files.append(None)
            continue
        try:
            st = os.stat(path)
        except OSError:
            return None
        files.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return (snapshot["tag"], snapshot["mem_mib"], snapshot.get("qemu"), snapshot.get("accel"), *files)


class Warm:
    """One pooled QEMU: its handle (not yet any child's), its monitor and agent connections;
    ``prerun``: its guest ran ahead and was paused again (see ``prerun``)."""

    def __init__(self, handle: Handle, qmp: QMP, channel: AgentChannel, key: tuple, cpu_ms: float,
                 prerun: bool = False):
        self.handle, self.qmp, self.channel, self.key, self.cpu_ms = handle, qmp, channel, key, cpu_ms
        self.prerun = prerun


class WarmPool:
    def __init__(self, engine: "VMEngine", size: int):
        self.engine = engine
        self.size = size
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # one got ready, or a filler ended
        self.ready: list[Warm] = []
        self.filling: dict[str, threading.Thread] = {}   # tag -> its filler
        self.used: list[str] = []                        # tags, least recently spawned first
        self.generation: dict[str, int] = {}             # bumped by drop: a filler's late QEMU is killed
        self.spawns: dict[str, int] = {}                 # tag -> spawns so far
        self.waiting: set[str] = set()                   # tags a spawn waits on the filler of
        self.closed = False
        self.seq = 0

    # --- serving a spawn -------------------------------------------------------------------------

    def take(self, snapshot: Handle) -> Warm | None:
        """A ready QEMU for ``snapshot`` (removed from the pool), or None."""
        if self.size <= 0:
            return None
        want = key(snapshot)
        if want is None:
            return None
        with self.lock:  # started for this snapshot's files as they were: of no use to anyone now
            stale = [w for w in self.ready if w.key[0] == want[0] and w.key != want]
            self.ready = [w for w in self.ready if w not in stale]
        for warm in stale:
            self.discard(warm)
        tag, deadline = want[0], time.monotonic() + LOAD_TIMEOUT
        while True:
            warm = self._ready_or_wait(tag, want, deadline)
            if warm is None:
                return None
            if self.engine.alive(warm.handle) and not warm.channel.broken:
                return warm
            self.discard(warm)  # died while it waited (killed from outside): a cold restore instead

    def _ready_or_wait(self, tag: str, want: tuple, deadline: float) -> Warm | None:
        """A ready one for ``want``, taken; or, while one is being started for it and no other spawn
        waits for it (a filler starts one at a time: more waiters would queue on it), that one once
        it is ready: it has a head start on a cold restore, and a cold one would start a second QEMU
        beside it, both slower on a busy host."""
        with self.lock:
            waiting = False
            try:
                while True:
                    warm = next((w for w in self.ready if w.key == want), None)
                    if warm is not None:
                        self.ready.remove(warm)
                        return warm
                    if tag not in self.filling or time.monotonic() >= deadline or \
                            (tag in self.waiting and not waiting):
                        return None
                    self.waiting.add(tag)
                    waiting = True
                    self.changed.wait(deadline - time.monotonic())
            finally:
                if waiting:
                    self.waiting.discard(tag)

    def adopt(self, warm: Warm, name: str) -> Handle:
        """Make ``warm`` the VM named ``name``: its directory renamed to that name's (QEMU holds its
        sockets, console and cwd by inode, so they move with it) and its agent connection the
        engine's."""
        h = warm.handle
        vm_dir = self.engine.qemu.vm_dir(name)
        shutil.rmtree(vm_dir, ignore_errors=True)
        os.rename(h["dir"], vm_dir)
        h.update(name=name, dir=vm_dir, qmp=os.path.join(vm_dir, "qmp.sock"),
                 socket=os.path.join(vm_dir, "agent.sock"))
        self.engine.adopt_channel(h, warm.channel)
        return h

    # --- filling ---------------------------------------------------------------------------------

    def fill(self, snapshot: Handle) -> None:
        """After a spawn of ``snapshot``: start, in the background, the QEMUs it lacks to have
        ``size`` ready, from its second spawn on. A snapshot spawned once (a notebook's branch for
        one fork, a stored sandbox's own state) would only leave QEMUs nobody takes."""
        if self.size <= 0 or key(snapshot) is None:
            return
        tag = snapshot["tag"]
        evict = []
        with self.lock:
            self.spawns[tag] = self.spawns.get(tag, 0) + 1
            if self.closed or self.spawns[tag] < 2:
                return
            if tag in self.used:
                self.used.remove(tag)
            self.used.append(tag)
            while len(self.used) > KEEP_SNAPSHOTS:
                old = self.used.pop(0)
                evict += self._drop_locked(old)
            if tag in self.filling:
                return
            thread = self.filling[tag] = threading.Thread(target=self._fill, args=(dict(snapshot),),
                                                          name=f"vm-warm-{tag}", daemon=True)
        for warm in evict:
            self.discard(warm)
        thread.start()

    def wait_filled(self, snapshot: Handle, timeout: float) -> bool:
        """Wait until ``snapshot``'s filler has finished (a benchmark's steady state)."""
        with self.lock:
            thread = self.filling.get(snapshot["tag"])
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _fill(self, snapshot: Handle) -> None:
        tag = snapshot["tag"]
        try:
            while True:
                want = key(snapshot)
                with self.lock:
                    if self.closed or want is None or tag not in self.used or \
                            sum(w.key == want for w in self.ready) >= self.size:
                        return
                    generation = self.generation.get(tag, 0)
                    self.seq += 1
                    name = f"warm:{tag}:{self.seq}"
                try:
                    warm = self._start(snapshot, name, want)
                except (EngineError, QMPError, AgentUnreachable, OSError):
                    return  # a cold restore still works; the next spawn tries again
                with self.lock:
                    keep = not self.closed and self.generation.get(tag, 0) == generation
                    if keep:
                        self.ready.append(warm)
                        self.changed.notify_all()
                if not keep:
                    self.discard(warm)
                    return
        finally:
            with self.lock:
                self.filling.pop(tag, None)
                self.changed.notify_all()

    def _start(self, snapshot: Handle, name: str, want: tuple) -> Warm:
        engine = self.engine
        h = engine.qemu.launch(name, snapshot["image"], snapshot["memory"], snapshot["mem_mib"], share=False,
                               incoming_file=snapshot["devices"], defer=True, paused=True,
                               packages=snapshot.get("packages_image"))
        qmp = channel = None
        try:
            qmp = QMP(h["qmp"], timeout=LOAD_TIMEOUT)
            qmp.execute("migrate-set-capabilities", {"capabilities": [{"capability": "events", "state": True}]})
            qmp.execute("migrate-incoming", {"uri": f"fd:{h.pop('incoming_fd')}"})
            while True:
                status = qmp.wait_event("MIGRATION", timeout=LOAD_TIMEOUT).get("data", {}).get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled"):
                    raise EngineError(f"loading the device state failed: {engine.qemu.log_tail(h)}")
            channel = AgentChannel(h["socket"])
            state = qmp.execute("query-status").get("status")
            if state != "paused":
                raise EngineError(f"a pre-started VM is {state!r} after its load, not paused")
            ahead = bool(snapshot.get("quiet"))
            if ahead:
                prerun(qmp, channel)
            return Warm(h, qmp, channel, want, engine.qemu.cpu_ms(h["pid"]), prerun=ahead)
        except BaseException:
            self.discard(Warm(h, qmp, channel, want, 0.0))
            raise

    # --- ending ----------------------------------------------------------------------------------

    def drop(self, tag: str, timeout: float = LOAD_TIMEOUT) -> None:
        """Kill the QEMUs pooled for snapshot ``tag`` (deleted, or its RAM file released), the one
        its filler may be starting included: when this returns, none is left."""
        with self.lock:
            gone = self._drop_locked(tag)
            if tag in self.used:
                self.used.remove(tag)
            self.spawns.pop(tag, None)
            filler = self.filling.get(tag)
        for warm in gone:
            self.discard(warm)
        if filler is not None and filler is not threading.current_thread():
            filler.join(timeout)  # it kills what it started once it sees the new generation

    def _drop_locked(self, tag: str) -> list[Warm]:
        self.generation[tag] = self.generation.get(tag, 0) + 1
        gone = [w for w in self.ready if w.key[0] == tag]
        self.ready = [w for w in self.ready if w.key[0] != tag]
        return gone

    def close(self, timeout: float = 30.0) -> None:
        """Kill every pooled QEMU, those still starting included."""
        with self.lock:
            self.closed = True
            gone, self.ready = self.ready, []
            fillers = list(self.filling.values())
        for warm in gone:
            self.discard(warm)
        for thread in fillers:  # each kills what it started once it sees ``closed``
            thread.join(timeout)

    def discard(self, warm: Warm) -> None:
        """Kill a pooled QEMU and remove its directory."""
        for conn in (warm.qmp, warm.channel):
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
        with contextlib.suppress(OSError, EngineError):
            self.engine.qemu.stop(warm.handle["pid"], warm.handle["start_time"])
        shutil.rmtree(warm.handle["dir"], ignore_errors=True)


def prerun(qmp: QMP, channel: AgentChannel) -> None:
    """Run a pooled VM's guest until its agent has answered a ping, then pause it again. Under TCG
    the guest's first run after a restore translates every code path afresh (the interrupt, the
    scheduler and timers, the agent's wake-up and reading); done here, off the spawn's path, the
    translations stay in this QEMU, and the child's restore runs mostly translated code. Only for a
    quiet snapshot (the agent's ``settle``: no thread or process of the user's in the guest), so no
    user code runs before its child's restore line, whose hygiene (entropy, clock, generators,
    identity) is the same as a cold child's; the guest merely idled a moment longer."""
    qmp.execute("cont")
    channel.call({"action": "ping"}, timeout=LOAD_TIMEOUT)
    qmp.execute("stop")
    state = qmp.execute("query-status").get("status")
    if state != "paused":
        raise EngineError(f"a pre-started VM is {state!r} after its run ahead, not paused")


def resume(warm: Warm, timeout: float) -> None:
    """Let a taken QEMU's guest run (its restore line is already sent)."""
    try:
        warm.qmp.execute("cont", timeout=timeout)
    finally:
        warm.qmp.close()
