"""The agent's SIGCHLD handling never blocks the thread it interrupts (the agent's main thread runs
user code and forks; a handler stuck there froze the whole sandbox, or a template for good)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Each scenario runs in a fresh interpreter (the module patches os.fork & co. for the process) and
# prints "free" once its main thread is past the SIGCHLD; the reaper thread then reaps the orphan.
PRELUDE = textwrap.dedent("""
    import ctypes, os, signal, sys, threading, time
    from forkd_engine.agent import children
    children.install()

    def orphan_exits():
        '''An agent's own fork (like a branch) that ends: a zombie for the reaper, and a SIGCHLD.'''
        pid = children.raw_fork()
        if pid == 0:
            os._exit(0)
        return pid

    def reaped(pid, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] != str(os.getpid()):
                        return True
            except OSError:
                return True
            time.sleep(0.01)
        return False
""")

SCENARIOS = {
    # A child whose main thread ended while another thread runs shows as a zombie but cannot be
    # waited for yet: a handler that reaped with waitpid(pid, 0) blocked here for the child's life.
    "a child that looks dead but is not": """
        hold_r, hold_w = os.pipe()
        busy = children.raw_fork()
        if busy == 0:
            threading.Thread(target=os.read, args=(hold_r, 1)).start()
            ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread only
        while open(f"/proc/{busy}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        pid = orphan_exits()
        os.kill(os.getpid(), signal.SIGCHLD)
        print("free", flush=True)
        assert reaped(pid), "the orphan was not reaped"
        os.write(hold_w, b"x")
        assert reaped(busy), "the child whose main thread ended was not reaped once it ended"
    """,
    # Another thread holds the lock that guards process creation (a user's Popen in progress): the
    # handler must not wait for it; the orphan is reaped once it is released.
    "the process-creation lock held elsewhere": """
        held, release = threading.Event(), threading.Event()
        def hold():
            with children._lock:
                held.set()
                release.wait()
        threading.Thread(target=hold).start()
        held.wait()
        pid = orphan_exits()
        os.kill(os.getpid(), signal.SIGCHLD)
        print("free", flush=True)
        release.set()
        assert reaped(pid), "the orphan was not reaped after the lock was released"
    """,
    # A storm of SIGCHLDs fills the wake-up pipe: the handler's write must fail, not wait.
    "the wake-up pipe full": """
        try:
            while True:
                os.write(children._wake_w, b"x" * 65536)
        except BlockingIOError:
            pass
        pid = orphan_exits()
        for _ in range(100):
            os.kill(os.getpid(), signal.SIGCHLD)
        print("free", flush=True)
        assert reaped(pid), "the orphan was not reaped with the pipe full"
    """,
}


def test_sigchld_never_blocks_the_interrupted_thread():
    for name, body in SCENARIOS.items():
        code = PRELUDE + textwrap.dedent(body)
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{name}: the main thread never got past SIGCHLD "
                                 f"(stdout {exc.stdout!r})") from None
        assert out.returncode == 0 and out.stdout == "free\n", f"{name}: {out.stdout!r} {out.stderr[-2000:]}"
