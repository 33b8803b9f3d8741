"""What the guest agent does, independent of how requests reach it.

One ``Runtime`` per sandbox: a persistent Python namespace shared by ``eval``, ``run_code`` and
streaming sessions (so a branch of a mid-thought agent keeps its variables), subprocess ``exec`` with
process-group timeouts, and a small file API. Replies follow forkd's agent protocol where forkd has
the action.

User code runs on the main thread when an ``Executor`` serves it there (every process-engine
sandbox), so it can be interrupted; without one (tests, a plain embedding) it runs in the caller.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from . import generators
from .cells import PlainRunner, collect
from .executor import Busy, Executor

MAX_FILE_BYTES = 64 * 1024 * 1024
_START = time.monotonic()


class AgentError(Exception):
    """A request the agent refuses; becomes ``{"error": ..., "exit_code": 1}``."""


def _error_reply(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "exit_code": 1}


class Runtime:
    def __init__(self, identity: dict | None = None):
        self.identity = dict(identity or {})
        self.namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
        self.eval_lock = threading.Lock()
        self.procs_lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen] = {}  # live exec children, by pid
        self.cwd = os.getcwd()
        self.started = time.time()
        self.executor: Executor | None = None
        self.plain = PlainRunner(self.namespace)
        self.shell = None        # the IPython shell, once a session asked for one (shell.py)
        self.history: list[dict] = []  # cells run through sessions: {n, code, sandbox, time}; forks keep it
        self.queue_wait = 10.0   # how long a call waits for a busy main thread before it is refused
        generators.install()     # before any user code: note the random generators made without a seed

    @property
    def runner(self):
        return self.shell if self.shell is not None else self.plain

    def start_session(self, request: dict, session) -> dict:
        """A streaming session opens: make the IPython shell if it asks for one; say what it gets."""
        if request.get("shell") == "ipython":
            self.ensure_shell(request)  # imported only where asked for: IPython is heavy
        if self.shell is not None:
            self.on_main(lambda: self.shell.attach(session), "attaching a session", user_code=False, wait=120)
        ipython = sys.modules.get("IPython")
        return {"status": "ok", "shell": "ipython" if self.shell is not None else "plain",
                "sandbox": self.identity.get("id"), "lineage": self.identity.get("lineage", []),
                "python": sys.version.split()[0], "ipython": getattr(ipython, "__version__", None),
                "execution_count": self.runner.execution_count, "history_length": len(self.history)}

    def on_main(self, fn, what: str, *, user_code: bool = True, wait: float | None = None):
        """Run ``fn`` where user code runs: the main thread's executor, else right here."""
        if self.executor is None:
            with self.eval_lock:
                try:
                    return fn()
                finally:
                    if user_code:
                        generators.notice()  # as the executor does after user code
        return self.executor.call(fn, what, user_code=user_code,
                                  start_within=self.queue_wait if wait is None else wait)

    # --- identity and fork hygiene --------------------------------------------------------------

    def after_fork(self, identity: dict) -> None:
        """Run first thing in a fresh fork: new identity, fresh locks, fresh random streams. A fork
        keeps only its calling thread: a lock another thread held would stay held for good, and
        the processes this one started are not its children."""
        self.eval_lock = threading.Lock()
        self.procs_lock = threading.Lock()
        self.procs = {}
        self.after_restore(identity)

    def after_restore(self, identity: dict) -> None:
        """Run first thing in a VM restored from a snapshot: new identity, fresh random streams. Its
        locks and processes stay as they are: the VM copied every thread and process, so a lock's
        holder runs on in the copy and releases it there."""
        self.identity = dict(identity)
        self.started = time.time()
        generators.reseed()
        reset_per_process_names()
        if self.shell is not None:
            self.shell.after_fork()

    # --- dispatch --------------------------------------------------------------------------------

    def handle(self, request: dict) -> dict:
        action = request.get("action")
        handler = {"ping": self.ping, "exec": self.exec, "eval": self.eval, "run_code": self.run_code,
                   "files": self.files, "interrupt": self.interrupt, "shell": self.ensure_shell}.get(action)
        if handler is None:
            return {"error": f"unknown action: {action}", "exit_code": 1}
        try:
            return handler(request)
        except AgentError as exc:
            return {"error": str(exc), "exit_code": 1}
        except Busy as exc:
            return {"error": str(exc), "busy": True, "exit_code": 1}
        except Exception as exc:  # noqa: BLE001 - the agent must answer, never die
            reply = _error_reply(exc)
            reply["traceback"] = traceback.format_exc()
            return reply

    def ensure_shell(self, request: dict) -> dict:
        """Make this sandbox's IPython shell now (a snapshot for the forkd kernel warms one up)."""
        if self.shell is None:
            from .shell import ForkdShell
            self.on_main(lambda: setattr(self, "shell", self.shell or ForkdShell.start(self)),
                         "starting IPython", user_code=False, wait=120)
        return {"shell": "ipython", "execution_count": self.shell.execution_count}

    def interrupt(self, request: dict) -> dict:
        running = self.executor.busy() if self.executor is not None else None
        done = self.executor.interrupt() if self.executor is not None else False
        return {"interrupted": done, "running": running[0] if running and done else None}

    def ping(self, request: dict) -> dict:
        busy = (self.executor.busy() or (None,))[0] if self.executor is not None else None
        return self._pong(self.identity, os.getpid(), round(time.time() - self.started, 3), busy)

    @staticmethod
    def _pong(identity: dict, pid: int, uptime: float, busy: str | None) -> dict:
        np = sys.modules.get("numpy")
        return {
            "pong": True,
            "pid": pid,
            "python": sys.version.split()[0],
            "agent_lang": "python",
            "numpy_version": getattr(np, "__version__", "not-installed"),
            "warmup_ready": True,
            "uptime_s": uptime,
            "sandbox_id": identity.get("id"),
            "role": identity.get("role", "sandbox"),
            "lineage": identity.get("lineage", []),
            "busy": busy,
        }

    @classmethod
    def ping_format(cls, identity: dict) -> bytes:
        """The ping's reply line (as ``encode_line`` puts it) of a sandbox of ``identity`` that runs
        nothing, as a printf format of its pid (%d) and uptime (%.3f): what a spawn's child answers
        while it idles in the template's C loop (process/fanout.c), before its first other request."""
        fields = []
        for key, value in cls._pong(identity, 0, 0.0, None).items():
            encoded = {"pid": "%d", "uptime_s": "%.3f"}.get(key)
            if encoded is None:
                encoded = json.dumps(value, separators=(",", ":")).replace("%", "%%")
            fields.append(f"{json.dumps(key)}:{encoded}")
        return ("{" + ",".join(fields) + "}\n").encode()

    # --- exec ------------------------------------------------------------------------------------

    def exec(self, request: dict) -> dict:
        args = request.get("args")
        if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
            raise AgentError("exec needs args: a non-empty list of strings")
        timeout = float(request.get("timeout", 30))
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
        cwd = request.get("cwd") or self.cwd
        # Registered under the lock it is started under, so a PID-1 reaper never steals its status.
        with self.procs_lock:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
            self.procs[proc.pid] = proc
        # The agent's RSS counts every page it shares with its snapshot, so under a memory limit
        # the OOM killer would pick it, ending the sandbox, before the command that really grew.
        # Raising a child's score is always allowed: commands are the first to go.
        with contextlib.suppress(OSError):
            with open(f"/proc/{proc.pid}/oom_score_adj", "w") as f:
                f.write("1000")
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            # The command may have started helpers: the whole process group goes.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        finally:
            with self.procs_lock:
                self.procs.pop(proc.pid, None)
        reply = {"stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace"),
                 "exit_code": proc.returncode}
        if timed_out:
            reply["timed_out"] = True
            reply["error"] = f"TimeoutExpired: command {args!r} timed out after {timeout:g} seconds"
        return reply

    def kill_children(self) -> None:
        with self.procs_lock:
            pids = list(self.procs)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    # --- Python ----------------------------------------------------------------------------------

    def eval(self, request: dict) -> dict:
        code = request.get("code")
        if not isinstance(code, str):
            raise AgentError("eval needs code: a string")

        def run() -> dict:
            try:
                value = eval(compile(code, "<eval>", "eval"), self.namespace)  # noqa: S307
            except Exception as exc:  # noqa: BLE001
                reply = _error_reply(exc)
                reply["traceback"] = traceback.format_exc()
                return reply
            return {"result": repr(value), "exit_code": 0}

        return self.on_main(run, "an eval", wait=request.get("queue_wait"))

    def run_code(self, request: dict) -> dict:
        """Run statements like a notebook cell; the last expression's value is the result."""
        code = request.get("code")
        if not isinstance(code, str):
            raise AgentError("run_code needs code: a string")
        return self.on_main(lambda: collect(lambda emit: self.runner.execute(code, emit, store_history=False)),
                            "a cell", wait=request.get("queue_wait"))

    # --- files -----------------------------------------------------------------------------------

    def _path(self, request: dict) -> str:
        path = request.get("path")
        if not isinstance(path, str) or not path or "\0" in path:
            raise AgentError("files needs path: a non-empty string")
        return os.path.join(self.cwd, path)

    def files(self, request: dict) -> dict:
        op = request.get("op")
        path = self._path(request)
        if op == "read":
            limit = min(int(request.get("max_bytes", MAX_FILE_BYTES)), MAX_FILE_BYTES)
            with _regular_file(path, os.O_RDONLY) as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(limit + 1)
            return {"path": path, "size": size, "truncated": len(data) > limit,
                    "data_b64": base64.b64encode(data[:limit]).decode()}
        if op == "write":
            data = base64.b64decode(request.get("data_b64", ""), validate=True)
            if len(data) > MAX_FILE_BYTES:
                raise AgentError(f"file too large: {len(data)} bytes (limit {MAX_FILE_BYTES})")
            if request.get("mkdirs", True):
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
            with _regular_file(path, flags) as f:
                f.write(data)
            if "mode" in request:
                os.chmod(path, int(request["mode"]))
            return {"path": path, "size": os.stat(path).st_size}
        if op == "list":
            entries = []
            with os.scandir(path) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    kind = "dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"
                    entries.append({"name": e.name, "type": kind, "size": st.st_size, "mtime": st.st_mtime})
            return {"path": path, "entries": sorted(entries, key=lambda x: x["name"])}
        if op == "remove":
            if os.path.isdir(path) and not os.path.islink(path):
                if not request.get("recursive"):
                    raise AgentError(f"{path} is a directory: pass recursive=true to remove it")
                import shutil
                shutil.rmtree(path)
            else:
                os.remove(path)
            return {"path": path, "removed": True}
        raise AgentError(f"unknown files op: {op!r} (read, write, list, remove)")


def _regular_file(path: str, flags: int):
    """``path`` opened as a file object, if it is a regular file. A FIFO, socket or device is
    refused without blocking (a FIFO's open or read would wait for a peer forever)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads, opened for writing
            raise AgentError(f"{path} is a FIFO, not a regular file: the files API reads and writes regular "
                             f"files only (use exec for anything else)") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise AgentError(f"{path} is {kind}, not a regular file: the files API reads and writes regular "
                             f"files only (use exec for anything else)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb" if flags & os.O_ACCMODE == os.O_RDONLY else "wb")
    except BaseException:
        os.close(fd)
        raise


def reset_per_process_names() -> None:
    """Per-process name state that keys on the pid, which a fork here keeps (every fork is pid 1 of
    its namespace, every VM child a copy of one process): ``tempfile`` would draw its siblings' names."""
    seq = getattr(tempfile, "_name_sequence", None)
    if seq is not None:
        seq._rng_pid = None  # its next use reseeds from os.urandom
    tempfile._name_sequence = None
