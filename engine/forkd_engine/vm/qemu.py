"""The QEMU processes of one engine: their command line, starting one on pre-bound sockets, reading
its logs, telling when its vCPUs have gone idle, and stopping it for good.

Its own room because every operation (creating a snapshot, spawning, branching, recovery) starts or
ends QEMU processes the same way, while none of this knows what a snapshot or a branch is: a
``Qemu`` is given paths and files and returns handles.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

from .. import linux
from ..base import EngineError, Handle
from .host import host_tsc_khz
from .image import DATA_SERIAL, PACKAGES_SERIAL

MAX_SOCKET_PATH = 107
STOP_WAIT = 10.0  # s a killed QEMU has to be gone (SIGKILL: only a process stuck in the kernel takes long)
MACHINE = "microvm"
DISK_ID = "d0"
PACKAGES_ID = "p0"  # the read-only packages disk (SnapshotSpec.packages), shared by every child
# QEMU's seccomp filter: no obsolete syscalls, no setuid/setgid/capset, no fork/exec, no
# scheduling or priority changes. A guest that escapes into QEMU meets it first.
SECCOMP_SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def tool(cmd: list[str]) -> None:
    """Run a host tool (``qemu-img``, ``mkfs.ext4``); EngineError says what failed."""
    try:
        subprocess.run(cmd, check=True, capture_output=True)
    except FileNotFoundError as exc:
        raise EngineError(f"{cmd[0]} is not installed (scripts/setup.sh installs it)") from exc
    except subprocess.CalledProcessError as exc:
        raise EngineError(f"{' '.join(cmd)} failed: {exc.stderr.decode(errors='replace').strip()[-800:]}") from exc


class Qemu:
    """Starts and stops the VMs of one engine: each in its own directory under ``run_dir``."""

    def __init__(self, binary: str, run_dir: str, accel: str, accel_opts: str, smp: int):
        self.binary = binary
        self.run_dir = run_dir
        self.accel = accel
        self.accel_opts = accel_opts
        self.smp = smp
        self.children: dict[int, subprocess.Popen] = {}  # the QEMUs this process started, by pid

    @functools.cached_property
    def tsc_khz(self) -> int | None:
        """The host's TSC frequency, which a boot tells the guest; read on first use (it runs
        ``dmesg``), not while the server starts."""
        return host_tsc_khz()

    def vm_dir(self, name: str) -> str:
        return os.path.join(self.run_dir, hashlib.sha1(name.encode()).hexdigest()[:16])

    def command(self, image: dict, mem_path: str, mem_mib: int, share: bool, qmp_fd: int, agent_fd: int,
                console: str, incoming: str | None, disk: tuple[str, str] | None = None,
                packages: str | None = None, paused: bool = False) -> list[str]:
        # panic=-1 reboot=t: a guest kernel that panics resets its CPU at once (a triple fault), and
        # -no-reboot makes that the end of its QEMU. The kernel's default ways (ACPI, the keyboard
        # controller, then the BIOS) left a panicked guest spinning in firmware, its QEMU running.
        # psi=0 cgroup_disable=memory nowatchdog: no pressure accounting, memory cgroups or lockup
        # watchdog in a one-purpose guest: their periodic work after each restore is guest code
        # every child would translate afresh under TCG (7 % of a restore's translated blocks).
        append = "console=ttyS0 quiet panic=-1 reboot=t tsc=reliable psi=0 cgroup_disable=memory nowatchdog"
        if self.tsc_khz:
            append += f" tsc_early_khz={self.tsc_khz}"
        cpu = "max" if self.accel == "tcg" else "host,-arch-capabilities"
        cmd = [self.binary, "-nodefaults", "-no-user-config", "-nographic", "-name", "forkd,debug-threads=on",
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
        if paused:
            cmd.append("-S")  # stays paused after its load: its guest runs on ``cont`` only
        return cmd

    def launch(self, name: str, image: dict, mem_path: str, mem_mib: int, share: bool,
               incoming_file: str | None = None, disk: tuple[str, str] | None = None,
               vm_dir_ready: bool = False, defer: bool = False, packages: str | None = None,
               paused: bool = False) -> Handle:
        vm_dir = self.vm_dir(name)
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
            cmd = self.command(image, mem_path, mem_mib, share, socks[0].fileno(), socks[1].fileno(),
                               os.path.join(vm_dir, "console.log"), incoming, disk, packages, paused)
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
        self.children[proc.pid] = proc
        start = linux.process_start_time(proc.pid)
        handle = {"engine": "vm", "kind": "vm", "name": name, "pid": proc.pid, "start_time": start,
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

    @staticmethod
    def log_tail(handle: Handle) -> str:
        parts = []
        for name in ("qemu.log", "console.log"):
            with contextlib.suppress(OSError), open(os.path.join(handle["dir"], name), "rb") as f:
                text = f.read()[-1500:].decode("utf-8", "replace").strip()
                if text:
                    parts.append(f"{name}: {text}")
        return "; ".join(parts) or "no output"

    @staticmethod
    def panic(handle: Handle) -> str | None:
        """The guest kernel's panic message, if its console shows one ("Kernel panic - not syncing: ...")."""
        with contextlib.suppress(OSError), open(os.path.join(handle["dir"], "console.log"), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
            found = re.findall(rb"Kernel panic - not syncing: ([^\r\n]*)", f.read())
            if found:
                return found[-1].decode("utf-8", "replace").strip()
        return None

    @staticmethod
    def cpu_ms(pid: int) -> float:
        """CPU time all threads of a QEMU have used so far (schedstat, ns resolution)."""
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e6

    @staticmethod
    def vcpu_ns(pid: int, waiting: bool = False) -> int:
        """CPU time (schedstat, ns) of a QEMU's vCPU threads, named "CPU n/ACCEL" (debug-threads);
        with ``waiting``, plus the time they spent runnable, waiting for a CPU (a busy guest on a
        busy host)."""
        return Qemu._vcpus(pid, waiting)[0]

    @staticmethod
    def _vcpus(pid: int, waiting: bool) -> tuple[int, bool]:
        """(``vcpu_ns``, whether a vCPU thread is running or runnable right now)."""
        total, runnable = 0, False
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    if not f.read().startswith("CPU "):
                        continue
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ran, waited = (int(x) for x in f.read().split()[:2])
                    total += ran + (waited if waiting else 0)
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    runnable |= f.read().rpartition(")")[2].split()[0] == "R"
        return total, runnable

    def wait_idle(self, handle: Handle, quiet: float = 0.03, limit: float = 1.0) -> bool:
        """Wait until the guest is idle: its vCPUs ran no guest code for ``quiet`` seconds (a halted
        vCPU thread sleeps). A snapshot saved mid-work (a thread still exiting, the agent still on
        its way back to read) makes every child finish that work again, translated afresh: ~10 % of
        a restore's CPU. A vCPU that waits for a CPU of a loaded host is busy, not quiet: it is
        runnable, though its counters move only once it runs. Bounded by ``limit``; returns
        whether the guest went quiet."""
        pid = handle["pid"]
        start = quiet_since = time.monotonic()
        last, _ = self._vcpus(pid, True)
        while time.monotonic() - start < limit:
            time.sleep(0.002)  # the sampling interval of the CPU counter, not a guess at readiness
            now, (used, runnable) = time.monotonic(), self._vcpus(pid, True)
            if used != last or runnable:
                last, quiet_since = used, now
            elif now - quiet_since >= quiet:
                return True
        return False

    def stop_recorded(self, vm_dir: str) -> int | None:
        """Stop the QEMU that ``launch`` recorded in ``vm_dir``'s pid file; its pid if it still ran."""
        with contextlib.suppress(OSError, ValueError, KeyError), open(os.path.join(vm_dir, "pid")) as f:
            rec = json.load(f)
            ran = rec["start_time"] is not None and linux.process_start_time(rec["pid"]) == rec["start_time"]
            self.stop(rec["pid"], rec["start_time"])
            return rec["pid"] if ran else None
        return None

    def stop(self, pid: int, start_time) -> bool:
        """SIGKILL QEMU ``pid`` (if it is still the one started at ``start_time``) and wait until it
        is gone, all its threads: only then are its cgroup leaves empty. False if it lives on."""
        proc = self.children.pop(pid, None)
        if proc is not None:  # our child: its pid cannot have been reused before we reap it
            with contextlib.suppress(OSError):
                proc.kill()
            try:
                proc.wait(timeout=STOP_WAIT)
            except subprocess.TimeoutExpired:
                self.children[pid] = proc
                return False
            return True
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return True
        try:
            current = linux.process_start_time(pid)
            if current is not None and current != start_time:
                return True  # another process has this pid now
            if current is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return linux.wait_pidfd(pidfd, STOP_WAIT)  # dying or dead: until every thread has exited
        finally:
            os.close(pidfd)

    def running_here(self) -> list[tuple[int, int | None, str]]:
        """(pid, start time, directory) of each process running in a VM directory of this engine
        that it did not start itself: QEMUs a previous server started (whose directory may be gone)."""
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in self.children:
                continue
            with contextlib.suppress(OSError):
                cwd = os.readlink(f"/proc/{entry.name}/cwd").removesuffix(" (deleted)")
                if cwd.startswith(self.run_dir + os.sep):
                    found.append((int(entry.name), linux.process_start_time(int(entry.name)), cwd))
        return found
