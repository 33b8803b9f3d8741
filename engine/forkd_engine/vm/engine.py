"""The VM engine: QEMU microVMs whose snapshots are files and whose children map them copy-on-write.

A snapshot is a directory: ``devices.bin`` (device state, written by QMP ``xen-save-devices-state``:
every device, no RAM), ``meta.json``, and ``memory.bin``, the guest's RAM as a plain file (kept on
tmpfs by default, see ``mem_root``). A parent boots with its RAM in that file (``share=on``), runs
its setup, stops, saves device state and quits: the file *is* the snapshot's memory, nothing is
copied. A child starts with ``-incoming`` on the device state and maps ``memory.bin`` privately
(``share=off``): every page it does not write stays the page cache's shared page.

Branching a running child (the new snapshot can be forked again, at any depth):

- ``full``: stop, write all of RAM (the base file's data plus every page the child changed), save
  device state, resume. The pause covers the whole write.
- ``diff``: copy the base file while the child runs; stop, read only the pages the child changed
  (``/proc/PID/pagemap``: present and no longer the file's page), save device state, resume; then
  lay the pages over the copy.
- ``live``: QEMU's ``background-snapshot`` (userfaultfd write-protect): the child pauses only while
  QEMU saves device state and arms write protection; RAM streams out while it runs and is turned
  into ``memory.bin`` off the critical path. Needs the RAM file on tmpfs (uffd-wp does not cover
  other file mappings) and root (``vm.unprivileged_userfaultfd=0``).

``pause_ms`` is QEMU's own STOP → RESUME event time for every mode.

The agent is the same as the process engine's (``forkd_engine.agent``) over virtio-serial. After
every restore the engine sends ``restore`` first (host entropy credited to the guest CRNG and a
forced reseed, wall clock stepped, Python RNGs reseeded, the child's identity); a child that does
not confirm it is killed, never handed out.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import queue
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .. import linux
from ..cgroups import Cgroups, subtree
from ..base import (AgentUnreachable, BranchResult, Cancelled, ChildSpec, EngineError, EngineUnavailable, Handle,
                    InvalidSpec, SnapshotSpec, UnsupportedMode)
from . import memory as vmem
from . import recovery
from .image import (DATA_SERIAL, PACKAGES_FILE, PACKAGES_SERIAL, Image, ImageError, PackageNotFound,
                    build_image, build_packages_image)
from .qmp import QMP, QMPError, event_time

QEMU = "qemu-system-x86_64"
DEFAULT_MEM_MIB = 256
MAX_SOCKET_PATH = 107
MACHINE = "microvm"
DISK_ID = "d0"
PACKAGES_ID = "p0"  # the read-only packages disk (SnapshotSpec.packages), shared by every child
# QEMU's seccomp filter: no obsolete syscalls, no setuid/setgid/capset, no fork/exec, no
# scheduling or priority changes. A guest that escapes into QEMU meets it first.
SECCOMP_SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


# --- host checks ---------------------------------------------------------------------------------

def qemu_binary() -> str | None:
    return shutil.which(QEMU)


def qemu_version(binary: str | None = None) -> str:
    out = subprocess.run([binary or qemu_binary() or QEMU, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else "unknown"


def kvm_status() -> tuple[bool, str]:
    """(usable, why). KVM counts only with hardware virtualisation; never on a PVM host."""
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return False, "/dev/kvm is PVM (kvm_pvm loaded): stock guest kernels fail under it, using TCG"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    if not re.search(r"\b(vmx|svm)\b", flags):
        return False, "the CPU shows neither vmx nor svm (nested or paravirtual KVM), using TCG"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not accessible to this user, using TCG"
    return True, "KVM with hardware virtualisation"


def host_tsc_khz() -> int | None:
    """The host TSC frequency, for the guest's ``tsc_early_khz`` (TCG guests see the host's TSC).
    Without it, boots sometimes hang calibrating against a PIT microvm does not have."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
        m = re.findall(r"tsc: (?:Refined TSC clocksource calibration|Detected): ([\d.]+) MHz", out)
        if m:
            return int(float(m[-1]) * 1000)
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("cpu MHz"))
        return int(float(line.split(":")[1]) * 1000)
    return None


# --- the host side of the agent channel ----------------------------------------------------------

class AgentChannel:
    """One connection to a VM's agent port, many requests in flight (matched by ``_rid``)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise AgentUnreachable(f"agent port {path} unreachable: {exc}") from exc
        self.token = secrets.token_hex(4)   # a child's inherited in-flight replies never match
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.pending: dict[str, list] = {}
        self.sessions: dict[str, queue.Queue] = {}  # streaming sessions on this port, by _sid
        self.error: str | None = None
        threading.Thread(target=self._reader, name="vm-agent-reader", daemon=True).start()

    def _reader(self) -> None:
        buf = bytearray()
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except OSError as exc:
                data, why = b"", str(exc)
            else:
                why = "the VM's agent port closed (did QEMU exit?)"
            if not data:
                self._fail(why)
                return
            buf += data
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue
                if isinstance(reply, dict) and "_sid" in reply:
                    with self.lock:
                        events = self.sessions.get(reply.pop("_sid"))
                    if events is not None:
                        events.put(reply)
                    continue
                rid = reply.pop("_rid", None) if isinstance(reply, dict) else None
                with self.lock:
                    slot = self.pending.pop(rid, None)
                if slot is not None:
                    slot[1] = reply
                    slot[0].set()

    def _fail(self, why: str) -> None:
        with self.lock:
            self.error = why
            slots, self.pending = list(self.pending.values()), {}
            sessions, self.sessions = list(self.sessions.values()), {}
        for slot in slots:
            slot[0].set()
        for events in sessions:
            events.put(None)

    @property
    def broken(self) -> bool:
        return self.error is not None

    def send(self, request) -> list:
        """Send without waiting; returns the slot ``wait`` takes. ``request`` is a dict (sent as JSON)
        or a function of the request id returning the whole line (the restore line)."""
        rid = f"{self.token}-{next(self.ids)}"
        slot = [threading.Event(), None, rid]
        with self.lock:
            if self.error:
                raise AgentUnreachable(self.error)
            self.pending[rid] = slot
        if callable(request):
            data = request(rid)
        else:
            data = json.dumps({**request, "_rid": rid}, separators=(",", ":")).encode() + b"\n"
        try:
            with self.send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            self._fail(str(exc))
            raise AgentUnreachable(f"agent port write failed: {exc}") from exc
        return slot

    def wait(self, slot: list, timeout: float) -> dict:
        if not slot[0].wait(timeout):
            with self.lock:
                self.pending.pop(slot[2], None)
            raise AgentUnreachable(f"the VM's agent did not answer within {timeout:g} s")
        if slot[1] is None:
            raise AgentUnreachable(self.error or "the VM's agent went away")
        return slot[1]

    def call(self, request: dict, timeout: float = 30.0) -> dict:
        return self.wait(self.send(request), timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def write(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            with self.send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            self._fail(str(exc))
            raise AgentUnreachable(f"agent port write failed: {exc}") from exc

    def open_session(self, options: dict) -> "VMSession":
        sid = f"{self.token}-s{next(self.ids)}"
        events: queue.Queue = queue.Queue()
        with self.lock:
            if self.error:
                raise AgentUnreachable(self.error)
            self.sessions[sid] = events
        self.write({**options, "action": "session", "_sid": sid})
        return VMSession(self, sid, events)


class VMSession:
    """A streaming session multiplexed on a VM's agent port (its lines carry ``_sid``)."""

    def __init__(self, channel: AgentChannel, sid: str, events: queue.Queue):
        self.channel, self.sid, self.events = channel, sid, events
        self.closed = False

    def send(self, message: dict) -> None:
        if self.closed:
            raise AgentUnreachable("the session is closed")
        self.channel.write({**message, "_sid": self.sid})

    def recv(self, timeout: float | None = None) -> dict | None:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no event from the VM's agent within {timeout:g} s") from None
        if event is None:
            self.closed = True
        return event

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self.channel.lock:
            self.channel.sessions.pop(self.sid, None)
        with contextlib.suppress(AgentUnreachable):
            self.channel.write({"_sid": self.sid, "type": "close"})
        self.events.put(None)


# --- the engine ----------------------------------------------------------------------------------

class VMEngine:
    name = "vm"

    def __init__(self, data_dir: str, *, mem_root: str | None = None, cache_dir: str | None = None,
                 accel: str | None = None, boot_timeout: float = 120.0, restore_timeout: float = 60.0,
                 smp: int = 1, restore_parallelism: int | None = None):
        self.qemu = qemu_binary()
        if self.qemu is None:
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
        self.accel_opts = os.environ.get("FORKD_VM_ACCEL_OPTS", "")
        self.boot_timeout = boot_timeout
        self.restore_timeout = restore_timeout
        self.cgroups = Cgroups(subtree("forkd-vm", self.data_dir))  # this server's own leaves
        self.smp = smp
        self.restore_parallelism = restore_parallelism or len(os.sched_getaffinity(0))
        self.qemu_version = qemu_version(self.qemu)
        self.tsc_khz = host_tsc_khz()
        self._image: Image | None = None
        self._image_lock = threading.Lock()
        self._channels: dict[tuple, AgentChannel] = {}
        self._channels_lock = threading.Lock()
        self._vm_locks: dict[tuple, threading.Lock] = {}
        self._children: dict[int, subprocess.Popen] = {}
        self._creating: dict[str, dict] = {}  # tag -> {"handle", "cancelled"} while its setup runs
        self._creating_lock = threading.Lock()
        self.started = time.time()  # what recover() may sweep predates this

    # --- image -----------------------------------------------------------------------------------

    def image(self) -> Image:
        with self._image_lock:
            if self._image is None:
                try:
                    self._image = build_image(self.cache_dir)
                except ImageError as exc:
                    raise EngineError(f"guest image build failed: {exc}") from exc
            return self._image

    # --- launching QEMU --------------------------------------------------------------------------

    def _vm_dir(self, name: str) -> str:
        return os.path.join(self.run_dir, hashlib.sha1(name.encode()).hexdigest()[:16])

    def _command(self, image: dict, mem_path: str, mem_mib: int, share: bool, qmp_fd: int, agent_fd: int,
                 console: str, incoming: str | None, disk: tuple[str, str] | None = None,
                 packages: str | None = None) -> list[str]:
        append = "console=ttyS0 quiet panic=-1 tsc=reliable"
        if self.tsc_khz:
            append += f" tsc_early_khz={self.tsc_khz}"
        cpu = "max" if self.accel == "tcg" else "host,-arch-capabilities"
        cmd = [self.qemu, "-nodefaults", "-no-user-config", "-nographic", "-name", "forkd,debug-threads=on",
               "-sandbox", SECCOMP_SANDBOX, "-accel", self.accel + self.accel_opts, "-cpu", cpu,
               "-m", f"{mem_mib}M", "-smp", str(self.smp)]
        if not incoming:
            # A restored child's RAM already holds the running kernel: loading the 50 MB ELF and the
            # initramfs again would only cost start-up time (-no-reboot: it never boots them).
            cmd += ["-kernel", image["kernel"], "-initrd", image["initrd"], "-append", append]
        cmd += ["-serial", f"file:{console}", "-no-reboot",
               "-chardev", f"socket,id=qmp,fd={qmp_fd},server=on,wait=off", "-mon", "chardev=qmp,mode=control",
               "-chardev", f"socket,id=agent,fd={agent_fd},server=on,wait=off",
               "-M", f"{MACHINE},memory-backend=mem",
               "-device", "virtio-serial-device", "-device", "virtserialport,chardev=agent,name=agent",
               "-object", f"memory-backend-file,id=mem,size={mem_mib}M,mem-path={mem_path},"
                          f"share={'on' if share else 'off'}",
               # Device state files carry no configuration section (xen-save-devices-state format).
               "-global", "migration.send-configuration=off"]
        if disk:
            path, fmt = disk
            cmd += ["-drive", f"file={path},if=none,id={DISK_ID},format={fmt}",
                    "-device", f"virtio-blk-device,drive={DISK_ID},serial={DATA_SERIAL}"]
        if packages:
            # Read-only and never written: every child of the snapshot opens the same file. The guest
            # finds it by its serial, whatever vdX it became.
            cmd += ["-drive", f"file={packages.replace(',', ',,')},if=none,id={PACKAGES_ID},format=raw,readonly=on",
                    "-device", f"virtio-blk-device,drive={PACKAGES_ID},serial={PACKAGES_SERIAL}"]
        if incoming:
            cmd += ["-incoming", incoming]
        return cmd

    def _launch(self, name: str, image: dict, mem_path: str, mem_mib: int, share: bool,
                incoming_file: str | None = None, disk: tuple[str, str] | None = None,
                vm_dir_ready: bool = False, defer: bool = False, packages: str | None = None) -> Handle:
        vm_dir = self._vm_dir(name)
        if not vm_dir_ready:
            shutil.rmtree(vm_dir, ignore_errors=True)
            os.makedirs(vm_dir, mode=0o700)
        socks = []
        state_fd = -1
        try:
            incoming = None
            if incoming_file:
                # The device state goes in as an open file (``fd:``), no shell or cat per child.
                state_fd = os.open(incoming_file, os.O_RDONLY)
                incoming = "defer" if defer else f"fd:{state_fd}"
            for sock_name in ("qmp.sock", "agent.sock"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind(os.path.join(vm_dir, sock_name))
                s.listen(8)
                socks.append(s)
            cmd = self._command(image, mem_path, mem_mib, share, socks[0].fileno(), socks[1].fileno(),
                                os.path.join(vm_dir, "console.log"), incoming, disk, packages)
            with open(os.path.join(vm_dir, "qemu.log"), "wb") as log:
                fds = [s.fileno() for s in socks] + ([state_fd] if state_fd >= 0 else [])
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        pass_fds=fds, start_new_session=True, cwd=vm_dir)
        except OSError as exc:
            shutil.rmtree(vm_dir, ignore_errors=True)
            raise EngineError(f"could not start QEMU: {exc}") from exc
        finally:
            for s in socks:
                s.close()
            if state_fd >= 0:
                os.close(state_fd)
        self._children[proc.pid] = proc
        start = linux.process_start_time(proc.pid)
        handle = {"engine": self.name, "kind": "vm", "name": name, "pid": proc.pid, "start_time": start,
                  "dir": vm_dir, "qmp": os.path.join(vm_dir, "qmp.sock"),
                  "socket": os.path.join(vm_dir, "agent.sock"), "mem_mib": mem_mib}
        if disk:
            handle["disk"] = disk[0]
        if packages:
            handle["packages_image"] = packages
        if defer:
            handle["incoming_fd"] = state_fd  # QEMU's copy keeps this number
        with open(os.path.join(vm_dir, "pid"), "w") as f:
            json.dump({"pid": proc.pid, "start_time": start}, f)
        return handle

    def _log_tail(self, handle: Handle) -> str:
        parts = []
        for name in ("qemu.log", "console.log"):
            with contextlib.suppress(OSError), open(os.path.join(handle["dir"], name), "rb") as f:
                text = f.read()[-1500:].decode("utf-8", "replace").strip()
                if text:
                    parts.append(f"{name}: {text}")
        return "; ".join(parts) or "no output"

    @staticmethod
    def _tool(cmd: list[str]) -> None:
        try:
            subprocess.run(cmd, check=True, capture_output=True)
        except FileNotFoundError as exc:
            raise EngineError(f"{cmd[0]} is not installed (scripts/setup.sh installs it)") from exc
        except subprocess.CalledProcessError as exc:
            raise EngineError(f"{' '.join(cmd)} failed: {exc.stderr.decode(errors='replace').strip()[-800:]}") from exc

    @classmethod
    def _overlay(cls, backing: str, fmt: str, path: str) -> None:
        cls._tool(["qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", fmt, path])

    # --- agent -----------------------------------------------------------------------------------

    @staticmethod
    def _key(handle: Handle) -> tuple:
        return handle["pid"], handle["start_time"]

    def _channel(self, handle: Handle) -> AgentChannel:
        key = self._key(handle)
        with self._channels_lock:
            ch = self._channels.get(key)
            if ch is None or ch.broken:
                if ch is not None:
                    ch.close()
                ch = self._channels[key] = AgentChannel(handle["socket"])
            return ch

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
        return self._channel(handle).open_session(options)

    def call(self, handle: Handle, request: dict, timeout: float | None = None) -> dict:
        if handle.get("kind") != "vm":
            raise EngineError("a VM snapshot has no running agent; spawn a sandbox from it")
        if not self.alive(handle):
            raise AgentUnreachable(f"QEMU process {handle['pid']} is gone")
        if request.get("action") == "restore":
            raise EngineError("restore is the engine's own action")
        return self._channel(handle).call(request, timeout or 30.0)

    @staticmethod
    def _restore_request(identity: dict):
        """The agent's ``restore`` line (``forkd_engine.agent.serial.parse_restore``): plain text, so
        a fresh child answers it without running (and translating) a JSON decoder first."""
        name = re.sub(r"[^A-Za-z0-9-]", "-", str(identity.get("id", "forkd")))[-63:].strip("-") or "forkd"
        texts = (str(identity.get("id", "")), str(identity.get("role", "")), name,
                 "\n".join(str(t) for t in identity.get("lineage") or []))
        tail = "%s %d %s\n" % (os.urandom(64).hex(), time.time_ns(), " ".join(t.encode().hex() for t in texts))
        return lambda rid: f"restore {rid} {tail}".encode()

    # --- liveness and memory ---------------------------------------------------------------------

    @staticmethod
    def _vcpu_ns(pid: int) -> int:
        """CPU time (schedstat, ns) of a QEMU's vCPU threads, named "CPU n/ACCEL" (debug-threads)."""
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    if not f.read().startswith("CPU "):
                        continue
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        return total

    def _wait_idle(self, handle: Handle, quiet: float = 0.03, limit: float = 1.0) -> bool:
        """Wait until the guest is idle: its vCPUs ran no guest code for ``quiet`` seconds (a halted
        vCPU thread sleeps). A snapshot saved mid-work (a thread still exiting, the agent still on
        its way back to read) makes every child finish that work again, translated afresh: ~10 % of
        a restore's CPU. Bounded by ``limit``; returns whether the guest went quiet."""
        pid = handle["pid"]
        start = quiet_since = time.monotonic()
        last = self._vcpu_ns(pid)
        while time.monotonic() - start < limit:
            time.sleep(0.002)  # the sampling interval of the CPU counter, not a guess at readiness
            now, used = time.monotonic(), self._vcpu_ns(pid)
            if used != last:
                last, quiet_since = used, now
            elif now - quiet_since >= quiet:
                return True
        return False

    def alive(self, handle: Handle) -> bool:
        if handle.get("kind") == "snapshot":
            return all(os.path.exists(handle[k]) for k in ("memory", "devices", "disk", "packages_image")
                       if k in handle) and \
                os.path.exists(os.path.join(handle["dir"], "meta.json"))
        return handle.get("start_time") is not None and \
            linux.process_start_time(handle["pid"]) == handle["start_time"]

    def memory(self, handle: Handle) -> dict:
        if handle.get("kind") == "snapshot":
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
            try:
                reply = self._channel(handle).call({"action": "ping"}, timeout)
            except AgentUnreachable as exc:
                return f"its agent does not answer ({exc})"
            return None if reply.get("pong") is True else f"its agent answered a ping with {reply!r:.200}"

        if not handles:
            return []
        with ThreadPoolExecutor(max_workers=min(32, len(handles))) as pool:
            return list(pool.map(one, handles))

    def recover(self, known: list[Handle]) -> list[str]:
        """At start-up: thaw each VM a live branch of the previous server left frozen (or stopped),
        then remove RAM files, snapshot and VM directories no handle in ``known`` owns."""
        # A VM one of our own branches is working on is not frozen but being written: left alone.
        vms = [h for h in known if h.get("kind") == "vm" and self.alive(h) and not self._vm_lock(h).locked()]
        found = []
        if vms:
            with ThreadPoolExecutor(max_workers=min(8, len(vms))) as pool:
                for h, done in zip(vms, pool.map(recovery.thaw, vms)):
                    found += [f"vm engine: {h['name']}: {line}" for line in done]
        return found + recovery.sweep(self, known)

    # --- killing ---------------------------------------------------------------------------------

    def _stop_process(self, pid: int, start_time) -> None:
        """SIGKILL QEMU ``pid`` (if it is still the one started at ``start_time``) and wait until it
        is gone, all its threads: only then are its cgroup leaves empty."""
        proc = self._children.pop(pid, None)
        if proc is not None:  # our child: its pid cannot have been reused before we reap it
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            return
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            current = linux.process_start_time(pid)
            if current is not None and current != start_time:
                return  # another process has this pid now
            if current is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # Dying or dead: a pidfd turns readable once every thread has exited. poll(), not
            # select(): descriptors may be past 1024.
            waiter = select.poll()
            waiter.register(pidfd, select.POLLIN)
            waiter.poll(10_000)
        finally:
            os.close(pidfd)

    def kill(self, handle: Handle) -> None:
        self._drop_channel(handle)
        self._stop_process(handle["pid"], handle.get("start_time"))
        shutil.rmtree(handle["dir"], ignore_errors=True)
        self.cgroups.remove(handle.get("cgroups") or [])

    def abandon(self, name: str) -> None:
        """End what an interrupted start left under ``name`` (no handle was recorded)."""
        vm_dir = self._vm_dir(name)
        with contextlib.suppress(OSError, ValueError, KeyError), open(os.path.join(vm_dir, "pid")) as f:
            rec = json.load(f)
            self._stop_process(rec["pid"], rec["start_time"])
        shutil.rmtree(vm_dir, ignore_errors=True)
        if name.startswith("snap:"):
            tag = name[5:]
            shutil.rmtree(os.path.join(self.snap_dir, tag), ignore_errors=True)
            shutil.rmtree(os.path.join(self.mem_root, tag), ignore_errors=True)

    def delete_snapshot(self, handle: Handle) -> None:
        # Children map memory.bin; unlinking leaves their mappings intact.
        shutil.rmtree(handle["dir"], ignore_errors=True)
        shutil.rmtree(os.path.dirname(handle["memory"]), ignore_errors=True)

    def close(self) -> None:
        """Close agent connections. VMs and snapshots outlive the server by design."""
        with self._channels_lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    # --- snapshots -------------------------------------------------------------------------------

    def _snapshot_paths(self, tag: str) -> tuple[str, str]:
        snap = os.path.join(self.snap_dir, tag)
        mem = os.path.join(self.mem_root, tag)
        for d in (snap, mem):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, mode=0o700)
        return snap, os.path.join(mem, "memory.bin")

    def _snapshot_handle(self, tag: str, snap: str, mem_path: str, mem_mib: int, image: dict,
                         lineage: list[str], packages: list[str] | None = None, **extra) -> Handle:
        meta = {"tag": tag, "qemu": self.qemu_version, "machine": MACHINE, "accel": self.accel,
                "mem_mib": mem_mib, "image": image, "lineage": lineage, "created_at": time.time(), **extra}
        if packages:
            meta["packages"] = packages
        with open(os.path.join(snap, "meta.json.tmp"), "w") as f:
            json.dump(meta, f)
        os.rename(os.path.join(snap, "meta.json.tmp"), os.path.join(snap, "meta.json"))
        handle = {"engine": self.name, "kind": "snapshot", "tag": tag, "dir": snap, "memory": mem_path,
                  "devices": os.path.join(snap, "devices.bin"), "mem_mib": mem_mib, "image": image,
                  "qemu": self.qemu_version, "accel": self.accel}
        if os.path.exists(os.path.join(snap, "disk.raw")):
            handle["disk"] = os.path.join(snap, "disk.raw")
        if os.path.exists(os.path.join(snap, PACKAGES_FILE)):
            handle["packages_image"] = os.path.join(snap, PACKAGES_FILE)
            handle["packages"] = packages or []
        return handle

    # --- the packages disk -----------------------------------------------------------------------

    def _packages_image(self, packages: list[str]) -> str | None:
        """The cached read-only ext4 image of ``packages`` (built on first use)."""
        try:
            return build_packages_image(self.cache_dir, packages)
        except PackageNotFound as exc:
            raise InvalidSpec(str(exc)) from exc
        except ImageError as exc:
            raise EngineError(f"packages {' '.join(map(str, packages))}: {exc}") from exc

    @staticmethod
    def _pin_packages(source: str, snap: str) -> None:
        """Give the snapshot its own name for the packages image (a hard link): its children's page
        caches hold blocks of exactly this file, so a rebuilt or removed cache entry must not change
        what they see. A copy where a link is impossible (another filesystem, a deleted file)."""
        dest = os.path.join(snap, PACKAGES_FILE)
        try:
            os.link(source, dest)
        except OSError:
            vmem.sparse_copy(source, dest, os.path.getsize(source))
            os.chmod(dest, 0o444)

    @staticmethod
    def _pin_base_disk(disk: str, vm_dir: str) -> str:
        """The child's own name for its snapshot's frozen disk (a hard link in its directory): its
        overlay chain is opened by path again at every branch, and the snapshot may be deleted
        while the child lives. The snapshot's path where a link is impossible."""
        pinned = os.path.join(vm_dir, "disk-base.raw")
        try:
            os.link(disk, pinned)
        except OSError:
            return disk
        return pinned

    @staticmethod
    def _held_file(handle: Handle, path: str) -> str:
        """The file the VM's QEMU opened as ``path``: ``path`` while it still names that file, else
        /proc/PID/fd/N (the snapshot that named it was deleted, or its tag reused since)."""
        fd_dir = f"/proc/{handle['pid']}/fd"
        with contextlib.suppress(OSError):
            for fd in os.listdir(fd_dir):
                held = os.path.join(fd_dir, fd)
                with contextlib.suppress(OSError):
                    if os.readlink(held) in (path, path + " (deleted)"):
                        with contextlib.suppress(OSError):
                            if os.path.samefile(held, path):
                                return path
                        return held
        raise EngineError(f"the sandbox's QEMU does not hold its packages disk {path} open")

    def create_snapshot(self, spec: SnapshotSpec) -> Handle:
        mem_mib = spec.mem_size_mib or DEFAULT_MEM_MIB
        free = self._mem_root_free_mib()
        if mem_mib > free:
            raise InvalidSpec(f"mem_size_mib {mem_mib} does not fit: a VM's RAM is a file in {self.mem_root}, whose "
                              f"filesystem has {free} MiB free")
        creating = {"handle": None, "cancelled": False}
        with self._creating_lock:
            if spec.tag in self._creating:
                raise EngineError(f"snapshot {spec.tag!r} is already being created")
            self._creating[spec.tag] = creating
        try:
            snapshot = self._create_snapshot(spec, mem_mib, creating)
        finally:
            with self._creating_lock:  # from here on cancel() no longer finds it: cancelled now, or never
                self._creating.pop(spec.tag, None)
        if creating["cancelled"]:
            self.delete_snapshot(snapshot)
            raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created")
        return snapshot

    def _mem_root_free_mib(self) -> int:
        path = self.mem_root
        while not os.path.exists(path):
            path = os.path.dirname(path)
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize >> 20

    def _create_snapshot(self, spec: SnapshotSpec, mem_mib: int, creating: dict) -> Handle:
        image = self.image().to_dict()
        packages = self._packages_image(spec.packages) if spec.packages else None
        snap, mem_path = self._snapshot_paths(spec.tag)
        handle = None
        try:
            if packages:
                self._pin_packages(packages, snap)
                packages = os.path.join(snap, PACKAGES_FILE)
            disk = None
            if spec.disk_mib:
                # The parent writes the raw ext4 image directly; after it is discarded the file is
                # the snapshot's frozen disk layer, and children get qcow2 overlays on it.
                disk = (os.path.join(snap, "disk.raw"), "raw")
                with open(disk[0], "wb") as f:
                    f.truncate(spec.disk_mib << 20)
                self._tool(["mkfs.ext4", "-q", "-F", "-L", "forkd-data", disk[0]])
            t0 = time.monotonic()
            with self._creating_lock:
                if creating["cancelled"]:
                    raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created")
                handle = creating["handle"] = self._launch("snap:" + spec.tag, image, mem_path, mem_mib, share=True,
                                                           disk=disk, packages=packages)
            channel = self._channel(handle)
            try:
                channel.call({"action": "ping"}, timeout=self.boot_timeout)
            except AgentUnreachable as exc:
                raise EngineError(f"the VM did not boot to its agent: {exc}; {self._log_tail(handle)}") from exc
            boot_ms = (time.monotonic() - t0) * 1000
            channel.call(self._restore_request({"id": spec.tag, "role": "template", "lineage": [spec.tag]}))
            # The setup's time limit covers it all (shell, commands, code), counted from here.
            deadline = time.monotonic() + spec.setup_timeout

            def left() -> float:
                if time.monotonic() >= deadline:  # the request's own setup: a 400, as a failing one
                    raise InvalidSpec(f"snapshot {spec.tag!r}: its setup did not finish within "
                                      f"{spec.setup_timeout:g} s (setup_timeout_secs) and was stopped")
                return deadline - time.monotonic()

            def setup_call(request: dict, margin: float = 0.0) -> dict:
                try:
                    return channel.call(request, timeout=left() + margin)
                except AgentUnreachable:
                    left()  # past the deadline: say so
                    raise

            if spec.shell == "ipython":
                reply = setup_call({"action": "shell"})
                if reply.get("error"):
                    raise EngineError(f"IPython could not start in the guest: {reply['error']} (add the Debian "
                                      f"package python3-ipython to the snapshot's packages)")
            for argv in spec.setup_commands:
                reply = setup_call({"action": "exec", "args": argv, "timeout": left()}, margin=10)
                if reply.get("exit_code") != 0:
                    if reply.get("timed_out"):
                        left()
                    raise InvalidSpec(f"setup command {argv!r} failed: exit {reply.get('exit_code')}: "
                                      f"{(reply.get('stderr') or reply.get('error') or '')[-1500:]}")
            if spec.setup:
                reply = setup_call({"action": "run_code", "code": spec.setup})
                if reply.get("error"):
                    err = reply["error"]
                    detail = f"{err.get('ename')}: {err.get('evalue')}" if isinstance(err, dict) else err
                    raise InvalidSpec(f"setup failed: {detail}")
            # Threads of the requests above may still be exiting: let them finish here, once, rather
            # than in every child after every restore.
            channel.call({"action": "settle"})
            self._wait_idle(handle)
            devices = os.path.join(snap, "devices.bin")
            with QMP(handle["qmp"]) as qmp:
                qmp.execute("stop")
                qmp.execute("xen-save-devices-state", {"filename": devices, "live": False})
                vmem.finish_device_state(devices)
                with contextlib.suppress(QMPError):
                    qmp.execute("quit")
            self.kill(handle)
            handle = None
            return self._snapshot_handle(spec.tag, snap, mem_path, mem_mib, image, [spec.tag],
                                         sorted(set(spec.packages)) or None, boot_to_agent_ms=round(boot_ms, 1))
        except BaseException as exc:
            if handle is not None:
                self.kill(handle)
            shutil.rmtree(snap, ignore_errors=True)
            shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
            if creating["cancelled"] and not isinstance(exc, Cancelled):
                raise Cancelled(f"snapshot {spec.tag!r}: deleted while it was being created; its VM was "
                                f"stopped") from exc
            if isinstance(exc, (QMPError, OSError, AgentUnreachable)) and not isinstance(exc, EngineError):
                raise EngineError(f"snapshot {spec.tag!r} failed: {exc}") from exc
            raise

    def cancel(self, tag: str) -> bool:
        """Stop the creation of snapshot ``tag`` if it runs here (its VM is killed)."""
        with self._creating_lock:
            creating = self._creating.get(tag)
            if creating is None:
                return False
            creating["cancelled"] = True
            handle = creating["handle"]
        if handle is not None:
            self._stop_process(handle["pid"], handle.get("start_time"))
        return True

    # --- sandboxes -------------------------------------------------------------------------------

    def _check_snapshot(self, snapshot: Handle) -> None:
        if snapshot.get("kind") != "snapshot":
            raise EngineError("not a VM snapshot handle")
        if not self.alive(snapshot):
            raise EngineError(f"snapshot {snapshot.get('tag')!r} is incomplete: its files are gone "
                              f"({snapshot['memory']}, {snapshot['devices']})")
        if snapshot.get("qemu") != self.qemu_version:
            raise EngineError(f"snapshot {snapshot.get('tag')!r} was made by {snapshot.get('qemu')!r}, this "
                              f"host runs {self.qemu_version!r}: device state is not portable across versions")
        if snapshot.get("accel") != self.accel:
            raise EngineError(f"snapshot {snapshot.get('tag')!r} was made under {snapshot.get('accel')}, "
                              f"this engine runs {self.accel}")

    def spawn(self, snapshot: Handle, children: list[ChildSpec]) -> list[Handle]:
        self._check_snapshot(snapshot)
        overlays: dict[str, tuple[str, str]] = {}
        if snapshot.get("disk"):
            # One qcow2 overlay per child over the snapshot's frozen disk, made in parallel.
            procs = []
            for child in children:
                vm_dir = self._vm_dir(child.id)
                shutil.rmtree(vm_dir, ignore_errors=True)
                os.makedirs(vm_dir, mode=0o700)
                overlays[child.id] = (os.path.join(vm_dir, "disk-0.qcow2"), "qcow2")
                procs.append(subprocess.Popen(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                                               self._pin_base_disk(snapshot["disk"], vm_dir),
                                               "-F", "raw", overlays[child.id][0]], stderr=subprocess.PIPE))
            failed = [p.stderr.read().decode(errors="replace") for p in procs if p.wait() != 0]
            for p in procs:
                p.stderr.close()
            if failed:
                for child in children:
                    shutil.rmtree(self._vm_dir(child.id), ignore_errors=True)
                raise EngineError(f"qemu-img create of a child's disk overlay failed: {failed[0].strip()}")
        started: list[Handle] = []      # every QEMU launched: all are killed if the spawn fails
        started_lock = threading.Lock()
        abandon = threading.Event()

        def restore(child: ChildSpec) -> Handle:
            if abandon.is_set():
                raise EngineError("spawn abandoned: another child failed")
            h = self._launch(child.id, snapshot["image"], snapshot["memory"], snapshot["mem_mib"],
                             share=False, incoming_file=snapshot["devices"], disk=overlays.get(child.id),
                             vm_dir_ready=child.id in overlays, defer=bool(snapshot.get("paused")),
                             packages=snapshot.get("packages_image"))
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
                    h["cgroups"] = self.cgroups.apply(child.id, h["pid"], child.memory_limit_mib, None)
                except OSError as exc:
                    raise EngineError(str(exc)) from exc
            # Connect before the guest runs: it then sees its host connected throughout.
            ch = self._channel(h)
            slot = ch.send(self._restore_request({"id": child.id, "role": "sandbox", "lineage": child.lineage}))
            if "incoming_fd" in h:
                self._incoming_and_cont(h, h.pop("incoming_fd"))
            try:
                reply = ch.wait(slot, self.restore_timeout)
            except AgentUnreachable as exc:
                raise EngineError(f"sandbox {child.id} did not come up: {exc}; {self._log_tail(h)}") from exc
            if not reply.get("restored"):
                raise EngineError(f"sandbox {child.id} refused its restore (entropy/clock/identity), "
                                  f"not serving it: {reply.get('error')}")
            return h

        # A restore is CPU-bound (under TCG: translating the guest's first code afresh). At most one
        # per CPU at a time: more would only share the CPUs, and each guest would then see more of
        # its own timer interrupts while it waits, costing more CPU in all.
        workers = max(1, min(self.restore_parallelism, len(children)))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vm-restore") if workers > 1 else None
        try:
            if pool is None:
                return [restore(child) for child in children]
            futures = [pool.submit(restore, child) for child in children]
            try:
                return [f.result() for f in futures]
            except BaseException:
                abandon.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        except BaseException:
            for h in started:
                with contextlib.suppress(Exception):
                    self.kill(h)
            for child_id in overlays:  # children that never started keep no overlay behind
                shutil.rmtree(self._vm_dir(child_id), ignore_errors=True)
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=False)

    def _incoming_and_cont(self, handle: Handle, fd: int) -> None:
        """Load device state saved from a stopped source (its children stay paused) and start it."""
        with QMP(handle["qmp"]) as qmp:
            qmp.execute("migrate-set-capabilities", {"capabilities": [{"capability": "events", "state": True}]})
            qmp.execute("migrate-incoming", {"uri": f"fd:{fd}"})
            while True:
                ev = qmp.wait_event("MIGRATION", timeout=self.restore_timeout)
                status = ev.get("data", {}).get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled"):
                    raise EngineError(f"loading the device state failed: {self._log_tail(handle)}")
            qmp.execute("cont")

    # --- branch ----------------------------------------------------------------------------------

    def _vm_lock(self, handle: Handle) -> threading.Lock:
        with self._channels_lock:
            return self._vm_locks.setdefault(self._key(handle), threading.Lock())

    def inventory(self, handle: Handle) -> list[str]:
        """Nothing: a VM branch copies the whole machine, threads, processes and sockets included."""
        return []

    def branch(self, sandbox: Handle, tag: str, lineage: list[str], mode: str = "full",
               lossy: bool = False) -> BranchResult:
        if sandbox.get("kind") != "vm":
            raise EngineError("only a running sandbox can be branched")
        if mode not in ("full", "diff", "live"):
            raise UnsupportedMode(f"unknown branch mode {mode!r}")
        if not self.alive(sandbox):
            raise EngineError(f"QEMU process {sandbox['pid']} is gone")
        mem_size = sandbox["mem_mib"] << 20
        if mode == "live":
            fstype = vmem.filesystem_type(sandbox["base_memory"]) if os.path.exists(sandbox["base_memory"]) else ""
            if fstype and fstype not in vmem.TMPFS_TYPES:
                raise UnsupportedMode(f"live branch needs the sandbox's RAM file on tmpfs (userfaultfd "
                                      f"write-protect cannot track {fstype} file mappings); this engine's "
                                      f"mem_root {self.mem_root} is on {fstype}")
        lock = self._vm_lock(sandbox)
        if not lock.acquire(timeout=600):
            raise EngineError("another branch of this sandbox did not finish within 600 s")
        snap = mem_path = None
        try:
            snap, mem_path = self._snapshot_paths(tag)
            image = None
            meta_path = os.path.join(self.snap_dir, sandbox["snapshot"], "meta.json")
            with contextlib.suppress(OSError, ValueError), open(meta_path) as f:
                image = json.load(f)["image"]
            if image is None:
                image = self.image().to_dict()
            if sandbox.get("packages_image"):
                # The branch's children need the very disk the source runs with (device state and
                # the guest's page cache refer to it).
                self._pin_packages(self._held_file(sandbox, sandbox["packages_image"]), snap)
            finish_args = (tag, snap, mem_path, sandbox["mem_mib"], image, lineage, sandbox.get("packages"))
            if mode == "live":
                return self._branch_live(sandbox, lock, finish_args, mem_size)
            pause_ms, prepare_ms, finish = self._branch_stopped(sandbox, mode, snap, mem_path, mem_size)
        except BaseException as exc:
            lock.release()
            if snap:
                shutil.rmtree(snap, ignore_errors=True)
                shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
            if isinstance(exc, (QMPError, OSError, AgentUnreachable, vmem.StreamError)):
                raise EngineError(f"branch {tag!r} ({mode}) failed: {exc}") from exc
            raise
        ready: Future = Future()

        def complete() -> None:
            try:
                finish()
                ready.set_result(self._snapshot_handle(*finish_args, branched_from=sandbox["name"], mode=mode,
                                                       pause_ms=pause_ms))
            except BaseException as exc:  # noqa: BLE001
                shutil.rmtree(snap, ignore_errors=True)
                shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
                ready.set_exception(exc if isinstance(exc, EngineError) else EngineError(f"branch {tag!r}: {exc}"))
            finally:
                lock.release()

        threading.Thread(target=complete, name=f"vm-branch-{tag}", daemon=True).start()
        return BranchResult(pause_ms=pause_ms, ready=ready, prepare_ms=prepare_ms)

    def _freeze_disk(self, qmp: QMP, sandbox: Handle) -> str | None:
        """While the VM is stopped: move it onto a fresh overlay; returns the layer now frozen."""
        if not sandbox.get("disk"):
            return None
        top = next((b["inserted"]["file"] for b in qmp.execute("query-block")
                    if b.get("device") == DISK_ID and b.get("inserted")), None)
        if top is None:
            raise EngineError("the sandbox's disk is not attached")
        n = len([f for f in os.listdir(sandbox["dir"]) if f.startswith("disk-") and f.endswith(".qcow2")])
        new = os.path.join(sandbox["dir"], f"disk-{n}.qcow2")
        qmp.execute("blockdev-snapshot-sync", {"device": DISK_ID, "snapshot-file": new, "format": "qcow2"})
        return top

    def _flatten_disk(self, frozen: str | None, snap: str) -> None:
        """The branch's disk as one standalone raw file (snapshots never depend on each other)."""
        if frozen:
            self._tool(["qemu-img", "convert", "-U", "-O", "raw", frozen, os.path.join(snap, "disk.raw")])

    def _branch_stopped(self, sandbox: Handle, mode: str, snap: str, mem_path: str, mem_size: int):
        """full / diff: returns (pause_ms, finish) where finish() completes memory.bin afterwards."""
        pid = sandbox["pid"]
        start, pgoff, base = vmem.find_ram_mapping(pid, mem_size)
        if pgoff != 0:
            raise EngineError("guest RAM is not mapped from the start of its file")
        devices = os.path.join(snap, "devices.bin")
        prepare_ms = 0.0
        view = None
        if mode == "diff":
            # While the child keeps running: copy the base (the file this child maps), map the copy,
            # and allocate the pages the child has changed so far (they stay changed). The pause
            # then copies only the changed pages, straight into their place.
            t0 = time.monotonic()
            vmem.sparse_copy(base, mem_path, mem_size)
            view = vmem.FileView(mem_path, mem_size)
            view.populate(vmem.private_runs(pid, start, mem_size))
            prepare_ms = round((time.monotonic() - t0) * 1000, 2)
        try:
            return self._pause_and_capture(sandbox, mode, snap, mem_path, mem_size, start, base, devices,
                                           view, prepare_ms)
        finally:
            if view is not None:
                view.close()

    def _pause_and_capture(self, sandbox, mode, snap, mem_path, mem_size, start, base, devices, view,
                           prepare_ms):
        pid = sandbox["pid"]
        with QMP(sandbox["qmp"]) as qmp:
            resumed = False
            steps: dict = {}
            clock = time.monotonic
            own_view = None
            qmp.execute("stop")
            try:
                stop_ev = qmp.wait_event("STOP", timeout=10)
                t = clock()
                if view is None:  # full: the whole copy happens inside the pause
                    vmem.sparse_copy(base, mem_path, mem_size)
                    view = own_view = vmem.FileView(mem_path, mem_size)
                    steps["copy_ms"] = (clock() - t) * 1000
                    t = clock()
                runs = vmem.private_runs(pid, start, mem_size)
                steps["pagemap_ms"] = (clock() - t) * 1000
                t = clock()
                view.read_from(pid, start, runs)
                steps["read_ms"] = (clock() - t) * 1000
                t = clock()
                qmp.execute("xen-save-devices-state", {"filename": devices, "live": False})
                frozen = self._freeze_disk(qmp, sandbox)
                steps["devices_ms"] = (clock() - t) * 1000
                qmp.execute("cont")
                resumed = True
                resume_ev = qmp.wait_event("RESUME", timeout=10)
            finally:
                if not resumed:
                    with contextlib.suppress(QMPError):
                        qmp.execute("cont")
                if own_view is not None:
                    own_view.close()
        pause_ms = round((event_time(resume_ev) - event_time(stop_ev)) * 1000, 2)
        vmem.finish_device_state(devices)
        dirty = sum(c for _f, c in runs) * vmem.PAGE

        def finish() -> None:
            self._flatten_disk(frozen, snap)
            with open(os.path.join(snap, "branch.json"), "w") as f:
                json.dump({"mode": mode, "pause_ms": pause_ms, "prepare_ms": prepare_ms, "dirty_bytes": dirty,
                           "steps_ms": {k: round(v, 2) for k, v in steps.items()}}, f)
        return pause_ms, prepare_ms, finish

    def _branch_live(self, sandbox: Handle, lock: threading.Lock, finish_args: tuple, mem_size: int) -> BranchResult:
        tag, snap, mem_path = finish_args[0], finish_args[1], finish_args[2]
        rfd, wfd = os.pipe()
        qmp = QMP(sandbox["qmp"])
        try:
            try:
                qmp.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "background-snapshot", "state": True},
                    {"capability": "events", "state": True}]})
            except QMPError as exc:
                if vmem.userfaultfds(sandbox["pid"]):
                    raise UnsupportedMode(f"a live branch of this sandbox failed earlier and its QEMU ({self.qemu_version}) "
                                          f"keeps that write tracking, so it refuses another ({exc}); branch it with "
                                          f"mode full or diff") from exc
                raise UnsupportedMode(f"live branch is impossible on this host: QEMU refused "
                                      f"background-snapshot ({exc})") from exc
            qmp.execute("getfd", {"fdname": "forkd-live"}, fds=[wfd])
            os.close(wfd)
            wfd = -1
            frozen = None
            if sandbox.get("disk"):
                # The disk is switched at the same instant: stop, new overlay, then the background
                # snapshot (which saves device state and starts the VM itself).
                qmp.execute("stop")
                frozen = self._freeze_disk(qmp, sandbox)
            qmp.execute("migrate", {"uri": "fd:forkd-live"})
            stop_ev = qmp.wait_event("STOP", timeout=30)
            resume_ev = qmp.wait_event("RESUME", timeout=60)
        except BaseException as exc:
            if wfd >= 0:
                os.close(wfd)
            os.close(rfd)
            with contextlib.suppress(QMPError):
                qmp.execute("migrate_cancel")
            with contextlib.suppress(QMPError):
                qmp.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "background-snapshot", "state": False}]})
            with contextlib.suppress(QMPError):
                qmp.execute("cont")  # never leave the source stopped
            qmp.close()
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"live branch failed to start: {exc}") from exc
        pause_ms = round((event_time(resume_ev) - event_time(stop_ev)) * 1000, 2)
        ready: Future = Future()

        def complete() -> None:
            try:
                with io.open(rfd, "rb", buffering=1 << 20) as stream:
                    device_state = vmem.split_stream(stream, mem_path, mem_size)
                # QEMU closed the stream; its MIGRATION event reports the final status.
                deadline = time.monotonic() + 60
                status = qmp.execute("query-migrate")
                while status.get("status") not in ("completed", "failed", "cancelled"):
                    if time.monotonic() > deadline:
                        break
                    with contextlib.suppress(QMPError):
                        qmp.wait_event("MIGRATION", timeout=max(0.01, deadline - time.monotonic()))
                    status = qmp.execute("query-migrate")
                if not status or status.get("status") != "completed":
                    raise EngineError(f"background snapshot ended {status and status.get('status')}: "
                                      f"{status and status.get('error-desc')}")
                with open(os.path.join(snap, "devices.bin"), "wb") as f:
                    f.write(device_state)
                self._flatten_disk(frozen, snap)
                with open(os.path.join(snap, "branch.json"), "w") as f:
                    json.dump({"mode": "live", "pause_ms": pause_ms,
                               "qemu_downtime_ms": status.get("downtime")}, f)
                result = self._snapshot_handle(*finish_args, branched_from=sandbox["name"], mode="live",
                                               pause_ms=pause_ms)
                if frozen:
                    result["paused"] = True  # saved from a stopped source: children need a cont
                ready.set_result(result)
            except BaseException as exc:  # noqa: BLE001
                shutil.rmtree(snap, ignore_errors=True)
                shutil.rmtree(os.path.dirname(mem_path), ignore_errors=True)
                qmp.close()  # its commands would wait on a vCPU the write-protect holds
                # The stream is closed: the source must run on, or be ended saying why.
                source = recovery.after_failed_live_branch(self, sandbox, str(exc))
                ready.set_exception(EngineError(f"live branch {tag!r} failed: {exc}; {source}"))
            else:
                with contextlib.suppress(QMPError):
                    qmp.execute("migrate-set-capabilities", {"capabilities": [
                        {"capability": "background-snapshot", "state": False}]})
                qmp.close()
            finally:
                lock.release()

        threading.Thread(target=complete, name=f"vm-branch-{tag}", daemon=True).start()
        return BranchResult(pause_ms=pause_ms, ready=ready)
