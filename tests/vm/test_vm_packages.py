"""The packages disk: Debian's numpy on a read-only ext4 image (virtio-blk) next to the data disk,
carried by every child and every branch."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import time

import pytest

from forkd_engine import ChildSpec, EngineError, SnapshotSpec

from .conftest import ev, requires_qemu, run

pytestmark = requires_qemu

def spawn(engine, snapshot, kids, n=1, prefix="np"):
    made = engine.spawn(snapshot, [ChildSpec(id=f"{prefix}{i}-{time.monotonic_ns()}") for i in range(n)])
    kids.extend(made)
    return made


def test_snapshot_records_a_read_only_packages_disk(vm_engine, np_snap, kids):
    path = np_snap["packages_image"]
    assert np_snap["packages"] == ["python3-numpy"]
    assert os.path.dirname(path) == np_snap["dir"] and not os.stat(path).st_mode & 0o222
    with open(path, "rb") as f:
        f.seek(1024 + 56)
        assert f.read(2) == b"\x53\xef"  # ext4 superblock magic
    (child,) = spawn(vm_engine, np_snap, kids)
    with open(f"/proc/{child['pid']}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert any(a.startswith(f"file={path},".encode()) and b"readonly=on" in a for a in argv)
    assert any(b"serial=forkd-pkgs" in a for a in argv) and any(b"serial=forkd-data" in a for a in argv)
    # in the guest: the disk is read-only, /usr stays writable (tmpfs upper layer), /data still mounts
    assert ev(vm_engine, child, "open('/data/note').read()") == "'from the parent'"
    mounts = ev(vm_engine, child, "open('/proc/mounts').read()")
    assert "/run/forkd-pkgs/ro ext4 ro" in mounts and "/usr overlay" in mounts
    reply = vm_engine.call(child, {"action": "exec", "args": ["sh", "-c", "touch /run/forkd-pkgs/ro/x"]})
    assert reply["exit_code"] != 0 and "Read-only" in reply["stderr"]
    run(vm_engine, child, "open('/usr/lib/python3/dist-packages/mine.py', 'w').write('v = 1')")
    (other,) = spawn(vm_engine, np_snap, kids)
    assert ev(vm_engine, other, "os.path.exists('/usr/lib/python3/dist-packages/mine.py')") == "False"


def test_children_compute_with_numpy_and_draw_their_own_streams(vm_engine, np_snap, kids):
    a, b = spawn(vm_engine, np_snap, kids, n=2)
    assert ev(vm_engine, a, "float((base * 2).sum())") == str(float(999_999 * 1_000_000))
    assert ev(vm_engine, b, "np.linalg.solve(np.array([[3.0, 1.0], [1.0, 2.0]]), np.array([9.0, 8.0])).tolist()") \
        == "[2.0, 3.0]"
    draws = [ast.literal_eval(ev(vm_engine, h, "(first_draw, np.random.rand(4).tolist())")) for h in (a, b)]
    assert draws[0][0] == draws[1][0]         # the parent's draw is memory, the same in both
    assert draws[0][1] != draws[1][1]         # reseeded at restore: each child its own stream
    assert draws[0][0] not in draws[0][1] + draws[1][1]


@pytest.mark.parametrize("mode", ["full", "diff", "live"])
def test_grandchild_of_a_branch_still_has_numpy(vm_engine, np_snap, kids, mode):
    (child,) = spawn(vm_engine, np_snap, kids)
    run(vm_engine, child, f"base *= 3\nmode = {mode!r}")
    snap = vm_engine.branch(child, f"np-{mode}", ["numpy", "c", mode], mode).ready.result(120)
    try:
        assert snap["packages"] == ["python3-numpy"] and os.path.exists(snap["packages_image"])
        assert os.path.samefile(snap["packages_image"], np_snap["packages_image"])  # one file, linked
        (grand,) = spawn(vm_engine, snap, kids, prefix="g")
        assert ev(vm_engine, grand, "(mode, base[:3].tolist())") == f"({mode!r}, [0.0, 3.0, 6.0])"
        # with the guest's page cache dropped, numpy's files come from the disk itself again
        run(vm_engine, grand, "os.sync()\nopen('/proc/sys/vm/drop_caches', 'w').write('3')")
        src = "/usr/lib/python3/dist-packages/numpy/version.py"
        digest = ev(vm_engine, grand, f"hashlib.sha256(open({src!r}, 'rb').read()).hexdigest()")
        host = subprocess.run(["debugfs", "-R", f"cat {src}", snap["packages_image"]], capture_output=True)
        assert digest.strip("'") == __import__("hashlib").sha256(host.stdout).hexdigest()
        assert ev(vm_engine, grand, "__import__('numpy.lib.recfunctions').__name__") == "'numpy'"
    finally:
        vm_engine.delete_snapshot(snap)


def test_bad_packages_fail_clearly_and_leave_nothing(vm_engine):
    with pytest.raises(EngineError, match="'Numpy!' is not a Debian package name"):
        vm_engine.create_snapshot(SnapshotSpec(tag="badname", packages=["Numpy!"]))
    with pytest.raises(EngineError, match="unknown Debian package 'no-such-package-forkd'.*apt-cache search"):
        vm_engine.create_snapshot(SnapshotSpec(tag="unknownpkg", packages=["no-such-package-forkd"]))
    for tag in ("badname", "unknownpkg"):
        assert not os.path.exists(os.path.join(vm_engine.snap_dir, tag))
        assert not os.path.exists(os.path.join(vm_engine.mem_root, tag))


def test_packages_image_is_cached(vm_engine, np_snap, monkeypatch):
    from forkd_engine.vm import packages

    def no_apt(names):
        raise AssertionError(f"resolved {names} again: the image was not remembered")

    monkeypatch.setattr(packages, "resolve_packages", no_apt)
    again = packages.build_packages_image(vm_engine.cache_dir, ["python3-numpy"])  # remembered: no apt, no build
    assert os.path.samefile(again, np_snap["packages_image"])
    assert stat.S_ISREG(os.stat(again).st_mode)
