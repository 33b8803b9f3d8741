"""``forkd doctor``'s row on cgroup moves, read from mountinfo files as the kernel writes them."""

from __future__ import annotations

import pytest

from forkd_server.doctor import _kernel_version, cgroup_mounts, check_cgroup_moves

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw{v2}
"""
UNIFIED = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw{v2},nsdelegate,memory_recursiveprot\n"
V1_ONLY = "35 31 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory{v1}\n"

new_kernel = pytest.mark.skipif(_kernel_version() < (6, 0),
                                reason="favordynmods exists from Linux 6.0")


def row(tmp_path, text: str) -> dict:
    path = tmp_path / "mountinfo"
    path.write_text(text)
    return check_cgroup_moves(str(path))


def test_mounts_are_read_with_their_superblock_options(tmp_path):
    (tmp_path / "mountinfo").write_text(HYBRID.format(v2=",favordynmods") + UNIFIED.format(v2=""))
    assert cgroup_mounts(str(tmp_path / "mountinfo")) == [
        ("/sys/fs/cgroup/memory", "cgroup", {"rw", "memory"}),
        ("/sys/fs/cgroup/pids", "cgroup", {"rw", "pids"}),
        ("/sys/fs/cgroup/unified", "cgroup2", {"rw", "favordynmods"}),
        ("/sys/fs/cgroup", "cgroup2", {"rw", "nsdelegate", "memory_recursiveprot"}),
    ]


@new_kernel
def test_without_favordynmods_the_fix_is_the_remount_of_the_v2_mount_and_the_boot_option(tmp_path):
    got = row(tmp_path, UNIFIED.format(v2=""))
    assert got["status"] == "info" and "RCU grace period" in got["detail"]
    assert "`mount -o remount,favordynmods /sys/fs/cgroup` (until the next boot)" in got["fix"] and "cgroup_favordynmods=true" in got["fix"]
    hybrid = row(tmp_path, HYBRID.format(v2=""))
    assert "`mount -o remount,favordynmods /sys/fs/cgroup/unified` (until" in hybrid["fix"]


@new_kernel
def test_v1_hierarchies_alone_can_only_take_it_at_boot(tmp_path):
    got = row(tmp_path, V1_ONLY.format(v1=""))
    assert got["status"] == "info" and "remount" not in got["fix"] and "cgroup_favordynmods=true" in got["fix"]


@new_kernel
def test_favordynmods_on_any_hierarchy_is_ok(tmp_path):
    # the lock it relaxes is one for the whole host, whichever hierarchy the flag was set on
    for text in (HYBRID.format(v2=",favordynmods"), UNIFIED.format(v2=",favordynmods"), V1_ONLY.format(v1=",favordynmods")):
        assert row(tmp_path, text)["status"] == "ok", text


def test_no_cgroup_filesystem(tmp_path):
    assert row(tmp_path, "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n")["status"] == "info"
