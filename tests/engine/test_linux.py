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
