"""``forkd doctor`` names the Debian packages the host lacks, with the apt-get line that installs
them; docs/install.md lists the same packages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from forkd_server.host_packages import GROUPS

REPO = Path(__file__).parents[2]


def doctor(tmp_path, path: str) -> tuple[int, dict]:
    """forkd doctor --json with ``path`` as PATH (what it probes for commands)."""
    done = subprocess.run([sys.executable, "-m", "forkd_server.cli", "doctor", "--json", "--data-dir", str(tmp_path),
                           "--url", "http://127.0.0.1:9"], env={**os.environ, "PATH": path},
                          capture_output=True, text=True, timeout=60)
    return done.returncode, {r["check"]: r for r in json.loads(done.stdout)}


def test_missing_process_engine_packages_fail_with_the_apt_get_line(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    status, rows = doctor(tmp_path, str(empty))  # no command on PATH: every command-probed package is missing
    row = rows["debian packages"]
    missing = [pkg for g in ("process", "vm") for pkg, probe, _ in GROUPS[g]
               if not (probe.startswith("/") and os.path.exists(probe))]
    assert "gcc" in missing and "qemu-utils" in missing
    assert (row["status"], row["required"], status) == ("fail", True, 1)
    assert row["fix"] == "apt-get install " + " ".join(missing)
    assert "gcc (the process engine compiles its sandboxes' init program with it)" in row["detail"]


def test_missing_vm_packages_only_warn(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "gcc").symlink_to(shutil.which("gcc") or "/bin/true")  # the process engine's part is there
    _, rows = doctor(tmp_path, str(tools))
    row = rows["debian packages"]
    if not os.path.exists("/usr/include/stdio.h"):
        assert row["status"] == "fail" and "libc6-dev" in row["fix"]
        return
    assert row["status"] == "warn"
    assert row["fix"] == "apt-get install qemu-system-x86 qemu-utils lz4 e2fsprogs"
    assert row["detail"].endswith("(the process engine works without them)")


def test_docs_name_every_package_and_what_needs_it():
    text = (REPO / "docs" / "install.md").read_text()
    for rows in GROUPS.values():
        for pkg, _, why in rows:
            assert f"| `{pkg}` | {why} |" in text, pkg


def test_a_kernel_without_the_signal_guards_seccomp_fails_the_seccomp_check(monkeypatch):
    """Process sandboxes' branches are guarded by seccomp user notification that lets a call go on
    (Linux 5.5): an older kernel is a required failure that says so, not a snapshot that fails later."""
    from forkd_server import doctor

    real = os.uname()
    for release, status in (("4.19.0", "fail"), ("5.4.0-150-generic", "fail"), ("5.5.0", "ok"), (real.release, "ok")):
        uname = os.uname_result((*real[:2], release, *real[3:]))
        monkeypatch.setattr(doctor.os, "uname", lambda uname=uname: uname)
        row = doctor.check_seccomp()
        assert (row["status"], row["required"]) == (status, status == "fail"), (release, row)
        if status == "fail":
            assert "Linux 5.5 or later" in row["fix"] and release in row["detail"]
