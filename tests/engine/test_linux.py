"""Host-side process facts the engines rely on (no namespaces involved)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from forkd_engine import linux

SYS_EXIT = 60  # x86_64: ends the calling thread only (exit_group ends them all)


def _state_and_threads(pid: int) -> tuple[bytes, int]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0], int(fields[17])


def test_a_process_whose_main_thread_ended_is_alive_until_its_last_thread_ends():
    """The kernel shows such a process as "Z" (an execve from another thread passes through this
    state too). Taking it for dead made a template with a live fork exit instead of becoming a
    reaper, and its pid namespace took the fork with it."""
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(release_w)
        threading.Thread(target=os.read, args=(release_r, 1)).start()
        ctypes.CDLL(None).syscall(SYS_EXIT, 0)
    try:
        os.close(release_r)
        deadline = time.monotonic() + 10
        while _state_and_threads(pid)[0] != b"Z":  # bounded wait for the main thread's end
            assert time.monotonic() < deadline, "the child's main thread did not end"
            time.sleep(0.01)
        assert _state_and_threads(pid)[1] > 1
        assert linux.process_start_time(pid) is not None
        os.write(release_w, b"x")  # the last thread ends: the process is dead (not yet reaped)
        assert os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT) is not None
        assert linux.process_start_time(pid) is None
    finally:
        os.close(release_w)
        os.kill(pid, signal.SIGKILL)  # if an assertion stopped us first
        os.waitpid(pid, 0)


def _errno_under_filter(deny_hugetlb: bool) -> dict:
    """In a child under the sandbox filter: the errno (0: it worked) of each way to map huge pages,
    and of an ordinary mapping."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            linux.install_seccomp(deny_hugetlb=deny_hugetlb)

            def errno_of(result: int) -> int:
                return ctypes.get_errno() if result in (-1, ctypes.c_void_p(-1).value, None) else 0

            prot, private = 3, 0x02 | 0x20  # read+write, MAP_PRIVATE | MAP_ANONYMOUS
            got = {"mmap": errno_of(libc.mmap(None, 2 << 20, prot, private | 0x40000 | 0x4000, -1, 0)),
                   "memfd_create": errno_of(libc.syscall(319, b"x", 0x4)),
                   "plain": errno_of(libc.mmap(None, 2 << 20, prot, private, -1, 0))}
            shm = libc.syscall(29, 0, 2 << 20, 0o4000 | 0o1000 | 0o600)  # IPC_PRIVATE, SHM_HUGETLB | IPC_CREAT
            got["shmget"] = errno_of(shm)
            if shm >= 0:
                libc.syscall(31, shm, 0, None)  # shmctl(IPC_RMID): a segment outlives its process
            os.write(w, repr(got).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return eval(text)  # noqa: S307 - our own child's repr of a dict of ints


def test_where_huge_pages_cannot_be_capped_the_filter_refuses_every_way_to_map_them():
    if os.uname().machine != "x86_64" or os.geteuid() != 0:
        import pytest
        pytest.skip("the syscall numbers here are x86_64's; the filter needs root's no_new_privs")
    assert _errno_under_filter(deny_hugetlb=True) == {"mmap": 1, "memfd_create": 1, "shmget": 1, "plain": 0}
    allowed = _errno_under_filter(deny_hugetlb=False)  # without: the kernel answers (ENOMEM at worst)
    assert 1 not in allowed.values() and allowed["plain"] == 0
