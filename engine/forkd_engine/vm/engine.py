"""The VM engine: QEMU microVMs whose snapshots are files and whose children map them copy-on-write.

``VMEngine`` is the engine protocol (``forkd_engine.base.Engine``) for VMs and little else: the
per-engine state (directories, accelerator, agent connections, a lock per VM) and the calls any
handle takes (call, alive, memory, probe, kill). The work is in rooms of its own:

- ``host``: probing the host (QEMU binary and version, KVM usable or not, TSC frequency);
- ``image``, ``packages``: building the guest image and the optional read-only packages disk;
- ``qemu``: QEMU processes: command line, launch on pre-bound sockets, logs, idleness, stopping;
- ``channel``: the agent channel over the VM's virtio-serial port, and the ``restore`` line;
- ``snapshots``: a snapshot's files, and creating one by booting a parent;
- ``spawning``: restoring children from a snapshot;
- ``warm``: QEMUs started and loaded ahead of a spawn, waiting paused for the next child;
- ``branching``: the ``full``, ``diff`` and ``live`` branch of a running VM;
- ``memory`` (guest RAM on the host), ``qmp`` (QEMU's monitor), ``recovery`` (repairs after a
  failed live branch or a restart);
- ``durable``: every snapshot's files kept in this host's chunk store (``forkd_engine.store``) and
  written back into tmpfs when they are gone (after a reboot), or imported from a pull.

The agent is the same as the process engine's (``forkd_engine.agent``) over virtio-serial.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .. import linux
from ..base import (AgentUnreachable, BranchResult, ChildSpec, EngineError, EngineUnavailable, ExitStatus, Handle,
                    LimitHit, PROBE_PARALLELISM, SnapshotSpec, ping_problem)
from ..cgroups import Cgroups, subtree
from ..store import ChunkCache, Manifest
from . import branching, durable, recovery, snapshots, spawning
from . import memory as vmem
from .channel import AgentChannel, VMSession
from .host import QEMU, kvm_status, qemu_binary, qemu_version
from .image import Image, ImageError, build_image
from .qemu import MAX_SOCKET_PATH, STOP_WAIT, Qemu
from .qmp import QMP, QMPError
from .warm import WarmPool


class VMEngine:
    name = "vm"

    def __init__(self, data_dir: str, *, mem_root: str | None = None, cache_dir: str | None = None,
                 accel: str | None = None, boot_timeout: float = 120.0, restore_timeout: float = 60.0,
                 smp: int = 1, restore_parallelism: int | None = None, store_cap_bytes: int | None = None,
                 warm: int | None = None):
        binary = qemu_binary()
        if binary is None:
            raise EngineUnavailable(f"{QEMU} is not installed (Debian: apt-get install qemu-system-x86; "
                                    "scripts/setup.sh does it)")
        self.data_dir = os.path.realpath(data_dir)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.snap_dir = os.path.join(self.data_dir, "snapshots")
        self.run_dir = os.path.join(self.data_dir, "run")
        # Guest images and package disks are built once per cache: $FORKD_VM_CACHE shares one
        # between data dirs (several servers, test runs), else it lives in this data dir.
        self.cache_dir = os.path.realpath(cache_dir or os.environ.get("FORKD_VM_CACHE")
                                          or os.path.join(self.data_dir, "cache"))
        for d in (self.snap_dir, self.run_dir, self.cache_dir):
            os.makedirs(d, mode=0o700, exist_ok=True)
        # Every snapshot's files as chunks on disk (durable.py): what outlives tmpfs, and what a
        # push sends and a pull fills. Over the cap, chunks no snapshot here uses are evicted.
        cap = store_cap_bytes or int(os.environ.get("FORKD_STORE_CACHE_BYTES") or 0) or None
        self.store = ChunkCache(os.path.join(self.data_dir, "store"), **({"cap_bytes": cap} if cap else {}))
        if len(os.path.join(self.run_dir, "x" * 16, "agent.sock")) > MAX_SOCKET_PATH:
            raise EngineUnavailable(f"data dir {self.data_dir!r} is too long for Unix socket paths; "
                                    "choose a shorter one")
        if mem_root is None:
            # Guest RAM files want tmpfs: fast to write, shared through the page cache, and the only
            # file memory that QEMU's live snapshot (userfaultfd write-protect) can track.
            if vmem.filesystem_type(self.data_dir) in vmem.TMPFS_TYPES or not os.path.isdir("/dev/shm"):
                mem_root = os.path.join(self.data_dir, "mem")
            else:
                digest = hashlib.sha1(self.data_dir.encode()).hexdigest()[:12]
                mem_root = f"/dev/shm/forkd-vm-{digest}"
        self.mem_root = os.path.realpath(mem_root)  # made on the first snapshot
        usable, why = kvm_status()
        self.accel = accel or ("kvm" if usable else "tcg")
        self.accel_reason = why if accel is None else f"accel={accel} chosen by the caller"
        self.preferred = self.accel == "kvm"
        self.boot_timeout = boot_timeout
        self.restore_timeout = restore_timeout
        self.cgroups = Cgroups(subtree("forkd-vm", self.data_dir))  # this server's own leaves
        self.restore_parallelism = restore_parallelism or len(os.sched_getaffinity(0))
        self.qemu = Qemu(binary, self.run_dir, self.accel, os.environ.get("FORKD_VM_ACCEL_OPTS", ""), smp)
        # QEMUs started and loaded ahead for the next children of the last snapshots spawned: one
        # per restore that may run at once ($FORKD_VM_WARM or ``warm`` sets how many, 0: none).
        env_warm = os.environ.get("FORKD_VM_WARM", "")
        self.warm = WarmPool(self, warm if warm is not None else
                             int(env_warm) if env_warm.isdigit() else self.restore_parallelism)
        self._image: Image | None = None
        self._image_lock = threading.Lock()
        self._channels: dict[tuple, AgentChannel] = {}
        self._channels_lock = threading.Lock()
        self._vm_locks: dict[tuple, threading.Lock] = {}
        self.creating: dict[str, dict] = {}  # tag -> {"handle", "cancelled"} while its setup runs
        self.creating_lock = threading.Lock()
        # A list to record each restore's stages in (perf_counter marks per child): for benchmarks.
        self.restore_trace: list[dict] | None = None
        self.started = time.time()  # what recover() may sweep predates this
        self.started_ticks = linux.boot_ticks()  # the same, in process start times' unit

    @functools.cached_property
    def qemu_version(self) -> str:
        """QEMU's version line, which every snapshot records: asked on first use (running QEMU takes
        0.1-0.5 s on a busy host), not while the server starts."""
        return qemu_version(self.qemu.binary)

    def warm_up(self) -> None:
        """What the engine needs soon but a start need not wait for; the server runs it on a thread
        once its port listens: numpy for the first branch's page scan (~0.4 s of imports), QEMU's
        version and the host's TSC frequency (a process each)."""
        vmem.warm()
        _ = self.qemu_version, self.qemu.tsc_khz

    # --- image -----------------------------------------------------------------------------------

    def image(self) -> Image:
        with self._image_lock:
            if self._image is None:
                try:
                    self._image = build_image(self.cache_dir)
                except ImageError as exc:
                    raise EngineError(f"guest image build failed: {exc}") from exc
            return self._image

    # --- agent -----------------------------------------------------------------------------------

    @staticmethod
    def _key(handle: Handle) -> tuple:
        return handle["pid"], handle["start_time"]

    def channel(self, handle: Handle) -> AgentChannel:
        """The agent connection of a running VM (one per VM, reopened when it broke)."""
        key = self._key(handle)
        with self._channels_lock:
            ch = self._channels.get(key)
            if ch is None or ch.broken:
                if ch is not None:
                    ch.close()
                ch = self._channels[key] = AgentChannel(handle["socket"])
            return ch

    def adopt_channel(self, handle: Handle, channel: AgentChannel) -> None:
        """Make ``channel`` (connected before the VM got its name: a pre-started one's) its channel."""
        with self._channels_lock:
            self._channels[self._key(handle)] = channel

    def _drop_channel(self, handle: Handle) -> None:
        with self._channels_lock:
            ch = self._channels.pop(self._key(handle), None)
        if ch is not None:
            ch.close()

    def open_session(self, handle: Handle, **options) -> VMSession:
        if handle.get("kind") != "vm":
            raise EngineError("a VM snapshot has no running agent; spawn a sandbox from it")
        if not self.alive(handle):
            raise AgentUnreachable(f"QEMU process {handle['pid']} is gone")
        return self.channel(handle).open_session(options)

    def call(self, handle: Handle, request: dict, timeout: float | None = None) -> dict:
        if handle.get("kind") != "vm":
            raise EngineError("a VM snapshot has no running agent; spawn a sandbox from it")
        if not self.alive(handle):
            raise AgentUnreachable(f"QEMU process {handle['pid']} is gone")
        if request.get("action") == "restore":
            raise EngineError("restore is the engine's own action")
        return self.channel(handle).call(request, timeout or 30.0)

    # --- liveness and memory ---------------------------------------------------------------------

    def alive(self, handle: Handle) -> bool:
        if handle.get("kind") == "snapshot":
            # files gone from tmpfs (a reboot) are written back from the store on first use
            return (all(os.path.exists(handle[k]) for k in ("memory", "devices", "disk", "packages_image")
                        if k in handle) and os.path.exists(os.path.join(handle["dir"], "meta.json"))) \
                or durable.restorable(self, handle)
        return handle.get("start_time") is not None and \
            linux.process_start_time(handle["pid"]) == handle["start_time"]

    def wait_exit(self, handle: Handle, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a VM's QEMU to exit; True once it has."""
        return linux.wait_exit(handle["pid"], handle.get("start_time"), timeout)

    def limits_hit(self, handle: Handle) -> list[LimitHit]:
        """The limits the kernel enforced on a VM's QEMU (its memory limit: the OOM killer)."""
        return self.cgroups.hits(handle.get("cgroups") or [])

    def raise_memory_limit(self, handle: Handle, memory_mib: int) -> None:
        """Raise the memory limit of a VM's QEMU process (its guest's memory size stays)."""
        try:
            self.cgroups.raise_memory(handle.get("cgroups") or [], memory_mib)
        except OSError as exc:
            raise EngineError(f"could not raise the memory limit of VM {handle.get('pid')}: {exc}") from exc
        if "memory_limit_mib" in handle:
            handle["memory_limit_mib"] = max(handle["memory_limit_mib"], memory_mib)

    def exit_status(self, handle: Handle) -> ExitStatus | None:
        """What ended a VM that ended on its own: its guest kernel's panic (read before ``kill``,
        which removes its console log). QEMU is no child of ours, so its own status is unknown."""
        message = self.qemu.panic(handle) if handle.get("kind") == "vm" else None
        return ExitStatus(note=f"its guest kernel panicked (Kernel panic - not syncing: {message})") if message else None

    def memory(self, handle: Handle) -> dict:
        if handle.get("kind") == "snapshot":
            if not os.path.exists(handle["memory"]):  # only in the store until its first use
                return {"rss_kib": 0, "pss_kib": 0, "uss_kib": 0, "file_kib": 0, "size_kib": handle["mem_mib"] << 10}
            st = os.stat(handle["memory"])
            return {"rss_kib": 0, "pss_kib": 0, "uss_kib": 0, "file_kib": st.st_blocks // 2,
                    "size_kib": st.st_size // 1024}
        if not self.alive(handle):
            raise EngineError(f"QEMU process {handle['pid']} is gone")
        return linux.smaps_memory(handle["pid"])

    def probe(self, handles: list[Handle], timeout: float = 5.0) -> list[str | None]:
        """Why each does not answer within ``timeout`` (None: it does): a snapshot's files must
        exist, a VM's agent must answer a ping. All at once."""
        def one(handle: Handle) -> str | None:
            if handle.get("kind") == "snapshot":
                return None if self.alive(handle) else f"its files are gone ({handle['memory']}, {handle['devices']})"
            if not self.alive(handle):
                return f"its QEMU process {handle['pid']} is gone"
            return ping_problem(lambda request: self.channel(handle).call(request, timeout))

        if not handles:
            return []
        with ThreadPoolExecutor(max_workers=min(PROBE_PARALLELISM, len(handles))) as pool:
            return list(pool.map(one, handles))

    def snapshot_warnings(self, handle: Handle) -> list[str]:
        """None: a VM's branches are files, out of its sandboxes' reach."""
        return []

    def repair(self, handle: Handle) -> list[str]:
        """At start-up, before ``probe``: thaw a VM a live branch of the previous server left frozen
        (or stopped). A VM one of our own branches is working on is being written: left alone."""
        if handle.get("kind") != "vm" or not self.alive(handle) or self.branch_lock(handle).locked():
            return []
        return recovery.thaw(handle)

    def recover(self, known: list[Handle]) -> list[str]:
        """At start-up: remove RAM files, snapshot and VM directories no handle in ``known`` owns,
        and end QEMUs no handle names."""
        return recovery.sweep(self, known)

    def branch_lock(self, handle: Handle) -> threading.Lock:
        """Held while a branch of this VM runs: one at a time, and recover() leaves such a VM alone."""
        with self._channels_lock:
            return self._vm_locks.setdefault(self._key(handle), threading.Lock())

    # --- freeze and thaw (the frozen tier) ---------------------------------------------------------

    def freeze(self, handle: Handle) -> None:
        """Stop the VM's vCPUs (QMP ``stop``): its RAM and devices stay as they are, no CPU is used."""
        self._run_state(handle, "stop")

    def thaw(self, handle: Handle) -> None:
        """Let a frozen VM run on (QMP ``cont``). Its guest clock lags by the time it was frozen."""
        self._run_state(handle, "cont")

    def _run_state(self, handle: Handle, command: str) -> None:
        if handle.get("kind") != "vm" or not self.alive(handle):
            raise EngineError(f"QEMU process {handle.get('pid')} is gone")
        try:
            with QMP(handle["qmp"], timeout=10) as qmp:
                qmp.execute(command)
        except QMPError as exc:
            raise EngineError(f"could not {'freeze' if command == 'stop' else 'thaw'} VM {handle['pid']}: {exc}") \
                from exc

    # --- killing ---------------------------------------------------------------------------------

    def kill(self, handle: Handle) -> None:
        self._drop_channel(handle)
        if not self.qemu.stop(handle["pid"], handle.get("start_time")):
            # Its directory (and pid file) stays: the next kill, or a restart's sweep, ends it.
            raise EngineError(f"QEMU process {handle['pid']} did not exit within {STOP_WAIT:g} s of SIGKILL")
        shutil.rmtree(handle["dir"], ignore_errors=True)
        self.cgroups.remove(handle.get("cgroups") or [])

    def abandon(self, name: str) -> None:
        """End what an interrupted start left under ``name`` (no handle was recorded)."""
        vm_dir = self.qemu.vm_dir(name)
        self.qemu.stop_recorded(vm_dir)
        shutil.rmtree(vm_dir, ignore_errors=True)
        if name.startswith("snap:"):
            tag = name[5:]
            shutil.rmtree(os.path.join(self.snap_dir, tag), ignore_errors=True)
            shutil.rmtree(os.path.join(self.mem_root, tag), ignore_errors=True)

    def delete_snapshot(self, handle: Handle) -> None:
        if handle.get("tag"):
            self.warm.drop(handle["tag"])
        # Children map memory.bin; unlinking leaves their mappings intact.
        shutil.rmtree(handle["dir"], ignore_errors=True)
        shutil.rmtree(os.path.dirname(handle["memory"]), ignore_errors=True)
        if handle.get("tag"):
            # its chunks stay while another snapshot's manifest lists them; the rest is cache
            self.store.unpin(handle["tag"])
            self.store.evict()

    # --- the store (durable.py) -----------------------------------------------------------------

    def host_requires(self) -> dict:
        """What this host offers a restore: QEMU version, machine type, accelerator, CPU model."""
        return durable.host_requires(self)

    def store_snapshot(self, handle: Handle, progress=None) -> str:
        """Keep a ready snapshot's files in the local store; returns its manifest digest."""
        return durable.store_snapshot(self, handle, progress)

    def release_files(self, handle: Handle) -> bool:
        """Free a stored snapshot's RAM file (tmpfs, i.e. RAM): the store holds it, and its next
        spawn writes it back. False (nothing freed) when the store does not hold it."""
        self.warm.drop(handle["tag"])  # they map the file: it would stay in RAM while they live
        return durable.release_files(self, handle)

    def materialise(self, handle: Handle, manifest: Manifest | None = None, remote=None) -> dict | None:
        """Write a snapshot's files back from the local store where they are gone, fetching what it
        lacks from ``remote`` in the same pass; the pass's figures, None if none was gone (a spawn
        does this by itself; called first, it is timed apart)."""
        return durable.ensure_files(self, handle, manifest, remote)

    def import_snapshot(self, manifest: Manifest, tag: str, lineage: list[str], remote=None,
                        progress=None) -> tuple[Handle, dict]:
        """Snapshot ``tag`` from a manifest (a pull): the chunks the local store lacks fetched from
        ``remote`` and written into its files in one pass. Returns its handle and the pull's figures."""
        return durable.import_snapshot(self, manifest, tag, lineage, remote, progress)

    def close(self) -> None:
        """Kill the pre-started QEMUs and close agent connections. VMs and snapshots outlive the
        server by design."""
        self.warm.close()
        with self._channels_lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()
        self.cgroups.close()
        with contextlib.suppress(OSError):  # nothing of ours holds RAM there: leave no empty folder
            os.rmdir(self.mem_root)

    # --- snapshots, sandboxes, branches ----------------------------------------------------------

    def create_snapshot(self, spec: SnapshotSpec) -> Handle:
        return snapshots.create(self, spec)

    def cancel(self, tag: str) -> bool:
        """Stop the creation of snapshot ``tag`` if it runs here (its VM is killed)."""
        return snapshots.cancel(self, tag)

    def spawn(self, snapshot: Handle, children: list[ChildSpec]) -> list[Handle]:
        return spawning.spawn(self, snapshot, children)

    def inventory(self, handle: Handle) -> list[str]:
        """Nothing: a VM branch copies the whole machine, threads, processes and sockets included."""
        return []

    def branch(self, sandbox: Handle, tag: str, lineage: list[str], mode: str = "full",
               lossy: bool = False) -> BranchResult:
        """``lossy`` changes nothing: a VM branch loses nothing (see ``inventory``)."""
        return branching.branch(self, sandbox, tag, lineage, mode)
