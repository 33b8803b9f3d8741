"""What the host offers the VM engine, probed before any VM exists: the QEMU binary and its version,
whether KVM is usable (and why not), and the TSC frequency a guest is told.

Its own room because the controller (is the engine available?), ``forkd doctor`` (which accelerator,
and why) and the engine itself all ask these questions, and none of them needs an engine to ask.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

QEMU = "qemu-system-x86_64"


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
