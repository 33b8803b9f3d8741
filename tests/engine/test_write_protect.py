"""``memory.lift_write_protect`` on a process holding a userfaultfd that protects nothing of the
range (QEMU unregistered it, or never registered RAM with it): nothing to lift, and no error. Its
``UFFDIO_WRITEPROTECT`` answers ENOENT there, which once escaped a restart's recovery and left a VM
data dir unstartable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from forkd_engine.vm import memory as vmem

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pidfd_getfd of another process needs root")

# A process with an initialised userfaultfd and an anonymous mapping it never registers.
HOLDER = textwrap.dedent("""
    import ctypes, fcntl, mmap, os, struct, sys
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(323, os.O_CLOEXEC)           # userfaultfd(2)
    if fd < 0:
        print("none", ctypes.get_errno(), flush=True)
        sys.exit(0)
    fcntl.ioctl(fd, 0xC018AA3F, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))   # UFFDIO_API
    area = mmap.mmap(-1, 1 << 20)
    area[0] = 1
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    print(address, flush=True)
    sys.stdin.read()
""")


def test_a_userfaultfd_without_a_write_protect_on_the_range_is_skipped():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        line = holder.stdout.readline().split()
        if line[0] == "none":
            pytest.skip(f"userfaultfd(2) is not available here (errno {line[1]})")
        address = int(line[0])
        assert vmem.userfaultfds(holder.pid), "the holder has no userfaultfd: the test proves nothing"
        assert vmem.lift_write_protect(holder.pid, address, 1 << 20) == 0
    finally:
        holder.stdin.close()
        holder.wait(10)
