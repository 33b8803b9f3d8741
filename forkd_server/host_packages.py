"""The Debian packages a host needs, by what needs them, and which of them are missing.

Each package is probed by what forkd uses from it (a command on PATH, a header), so a host that has
the tool some other way counts as having it. ``forkd doctor`` names the missing ones with the
``apt-get install`` line; ``scripts/setup.sh`` installs them, asking this file (standard library
only: it runs before forkd is installed) which are missing; docs/install.md lists them.
"""

from __future__ import annotations

import os
import shutil
import sys

# group -> [(Debian package, probe, what needs it)]; a probe starting with "/" is a file, else a command
GROUPS = {
    "process": [
        ("gcc", "gcc", "the process engine compiles its sandboxes' init program with it"),
        ("libc6-dev", "/usr/include/stdio.h", "the C library's headers and start files for that build"),
    ],
    "vm": [
        ("qemu-system-x86", "qemu-system-x86_64", "runs the VM engine's microVMs"),
        ("qemu-utils", "qemu-img", "VM disk overlays and branches of disks"),
        ("lz4", "lz4", "unpacks Debian's guest kernel for the VM image"),
        ("e2fsprogs", "mkfs.ext4", "VM data disks and package disks"),
    ],
    "test": [
        ("chromium", "/usr/bin/chromium", "the browser tests (Playwright drives Debian's Chromium)"),
        ("openssl", "openssl", "the TLS test's certificate"),
        ("git", "git", "the newcomer test's clone"),
        ("npm", "npm", "installs JupyterHub's proxy (configurable-http-proxy) for tests/hub"),
    ],
}


def present(probe: str) -> bool:
    return os.path.exists(probe) if probe.startswith("/") else shutil.which(probe) is not None


def missing(*groups: str) -> list[tuple[str, str]]:
    """(package, what needs it) for each package of ``groups`` whose probe fails."""
    return [(pkg, why) for g in groups for pkg, probe, why in GROUPS[g] if not present(probe)]


def install_line(packages) -> str:
    return "apt-get install " + " ".join(packages)


if __name__ == "__main__":  # scripts/setup.sh: the missing packages of the groups named, one line
    print(" ".join(pkg for pkg, _ in missing(*sys.argv[1:])))
