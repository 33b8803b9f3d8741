"""The agent's transport inside a VM: line-delimited JSON over a virtio-serial port.

The host keeps one connection to the port and may have several requests in flight: each request
carries ``_rid`` and its reply echoes it, so a reply that outlives its caller (a long ``run_code`` in
a VM that was branched meanwhile) is recognised and dropped by the host. Every request runs in its
own thread; replies are written whole under a lock.

Two VM-only actions live here:

- ``restore``: run first after every restore from a snapshot, before the host lets anyone else talk
  to the child. It mixes host entropy into the guest kernel's pool and forces a CRNG reseed, steps the wall
  clock to the host's, reseeds Python's generators and takes the child's identity (its hostname
  and an /etc/machine-id of its own). A child whose
  ``restore`` failed is never handed out (the host fails closed). Under TCG every guest instruction
  a child runs for the first time is translated again in that child's QEMU, so this path is kept
  short: it is one plain line, not JSON (see ``parse_restore``), answered by a formatted line; raw
  fds kept open from the parent's restore (``RestoreFiles``), no file objects, no hashing, no floats.
- ``settle``: asked for just before a snapshot is saved. It waits until the threads of finished
  requests have left the kernel; a snapshot taken while one is still exiting would make every child
  finish that exit again, thousands of fresh translations per restore. It also says whether the
  guest is ``quiet``: no thread but the agent's own, no timer armed and no process but the agent
  and the kernel's threads, so nothing of the user's runs before a restore line, however long the
  guest runs first (the host may then run a pre-started copy ahead: vm/warm.py).

Run as ``python3 -m forkd_engine.agent.serial`` (the guest's /init does).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import threading
import time

from . import children
from .executor import Executor
from .inventory import other_threads, user_processes
from .runtime import Runtime
from .server import MAX_LINE, encode_line
from .session import Session, error_content

PORT_NAME = "agent"
INLINE = ("ping", "settle")  # answered on the reader thread; everything else gets its own thread
RNDRESEEDCRNG = 0x5207       # _IO('R', 0x07)


def find_port(name: str = PORT_NAME, timeout: float = 30.0) -> str:
    """The /dev node of the virtio-serial port called ``name`` (udev-less: read sysfs)."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        base = "/sys/class/virtio-ports"
        if os.path.isdir(base):
            for port in sorted(os.listdir(base)):
                try:
                    with open(os.path.join(base, port, "name")) as f:
                        if f.read().strip() == name and os.path.exists(f"/dev/{port}"):
                            return f"/dev/{port}"
                except OSError:
                    continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"no virtio-serial port named {name!r} appeared")
        time.sleep(delay)  # the driver is still probing: nothing to wait on but sysfs
        delay = min(delay * 2, 0.1)


def add_entropy(fd: int, seed: bytes) -> None:
    """Mix ``seed`` into the kernel's input pool (``fd``: /dev/random) and reseed the CRNG from it
    now: every reader after this, the kernel's own included, draws from a key that depends on it.
    (Crediting it would change nothing: a restored guest's CRNG is long initialised.)"""
    os.write(fd, seed)
    fcntl.ioctl(fd, RNDRESEEDCRNG)


def timers_armed() -> bool:
    """Whether a timer of this process would run user code by a signal: an interval timer (which
    ``signal.alarm`` and ``setitimer`` arm) or a POSIX timer (``/proc/self/timers``)."""
    if any(signal.getitimer(which) != (0.0, 0.0)
           for which in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)):
        return True
    try:
        with open("/proc/self/timers", "rb") as f:
            return bool(f.read().strip())
    except OSError:  # a kernel without it (no CONFIG_CHECKPOINT_RESTORE): nothing known to be armed
        return False


def quiet() -> bool:
    """Whether nothing of the user's would run in this guest: no thread but the agent's own (the
    reader, ``forkd-`` threads), no timer armed, and no process but the agent, PID 1 and kernel
    threads."""
    return not (other_threads() or timers_armed() or user_processes())


RESTORE = b"restore "
MACHINE_ID = "/etc/machine-id"  # each child's own, as each process sandbox has


class RestoreFiles:
    """The files every restore writes, opened once (by the snapshot's parent, at its own restore)
    and kept open: a child then writes them with no path lookup, open or close, kernel code it
    would otherwise translate afresh under TCG. The guest's /init binds /etc/machine-id over itself,
    so no code can remove it or rename another file over it: the inode kept open stays the file.
    Where that bind is missing, a machine id removed or replaced since is found (its inode has no
    name left: one ``fstat``) and opened afresh."""

    def __init__(self):
        self.random = os.open("/dev/random", os.O_WRONLY | os.O_CLOEXEC)
        self.hostname = os.open("/proc/sys/kernel/hostname", os.O_WRONLY | os.O_CLOEXEC)
        self.machine_id = self._open_machine_id()
        with open("/proc/self/mountinfo", "rb") as f:
            self.bound = any(line.split()[4] == MACHINE_ID.encode() for line in f)

    @staticmethod
    def _open_machine_id() -> int:
        return os.open(MACHINE_ID, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o444)

    def write_machine_id(self, data: bytes) -> None:
        if not self.bound and os.fstat(self.machine_id).st_nlink == 0:
            os.close(self.machine_id)
            self.machine_id = self._open_machine_id()
        # Over the first 33 bytes: the file is 33 bytes unless the user's code wrote more, whose
        # tail then stays behind this child's own id.
        os.pwrite(self.machine_id, data, 0)


def parse_restore(line: bytes) -> tuple[str, bytes, int, dict]:
    """``restore RID ENTROPY TIME_NS ID ROLE HOSTNAME LINEAGE``: ENTROPY and the four strings are hex
    (the strings UTF-8, LINEAGE joined by newlines), TIME_NS the host's wall clock in integer ns.
    Returns (rid, entropy, time_ns, identity)."""
    rid, entropy, time_ns, sid, role, hostname, lineage = line[len(RESTORE):].split(b" ")
    lineage = _unhex(lineage)
    identity = {"id": _unhex(sid), "role": _unhex(role), "hostname": _unhex(hostname),
                "lineage": lineage.split("\n") if lineage else []}
    return rid.decode(), bytes.fromhex(entropy.decode()), int(time_ns), identity


def _unhex(field: bytes) -> str:
    return bytes.fromhex(field.decode()).decode()


class SerialAgent:
    """Requests carry ``_rid`` (replies echo it). A streaming session shares the port: it is opened
    by ``{"action": "session", "_sid": S}``, its messages and events carry ``_sid``, and
    ``{"_sid": S, "type": "close"}`` ends it."""

    def __init__(self, fd: int, runtime: Runtime):
        self.fd = fd
        self.runtime = runtime
        self.write_lock = threading.Lock()
        self.restores = 0
        self.sessions: dict[str, Session] = {}
        self.files: RestoreFiles | None = None

    def restore(self, seed: bytes, host_ns: int, identity: dict, max_drift_ns: int = 500_000_000) -> int:
        """Fork hygiene after a restore; returns how far the clock was stepped (ns). Role ``wake``
        (the same sandbox restored from its stored state, not a copy): the clock alone is stepped,
        and its generators, identity and machine id stay as they were."""
        if len(seed) < 32:
            raise ValueError("restore needs at least 32 bytes of entropy")
        if self.files is None:
            self.files = RestoreFiles()
        files = self.files
        add_entropy(files.random, seed)
        stepped_ns = host_ns - time.time_ns()
        if abs(stepped_ns) > max_drift_ns:
            time.clock_settime_ns(time.CLOCK_REALTIME, host_ns)
        if identity["role"] == "wake":
            self.restores += 1
            return stepped_ns
        self.runtime.after_restore(identity)  # reseeds Python's generators from the reseeded CRNG
        hostname = identity["hostname"]
        if hostname:
            os.pwrite(files.hostname, hostname[:64].encode(), 0)
        # From the reseeded CRNG; the guest's / is its own RAM, so a plain file is its own.
        files.write_machine_id(os.urandom(16).hex().encode() + b"\n")
        self.restores += 1
        return stepped_ns

    def serve_restore(self, line: bytes) -> None:
        rid = None
        try:
            rid, seed, host_ns, identity = parse_restore(line)
            self.restore(seed, host_ns, identity)
        except Exception as exc:  # noqa: BLE001 - the host fails closed on an error reply
            reply = {"error": f"{type(exc).__name__}: {exc}", "exit_code": 1}
            if rid is not None:
                reply["_rid"] = rid
            with contextlib.suppress(OSError):
                self.reply(reply)
            return
        with contextlib.suppress(OSError):  # the host went away; it will not wait for this reply
            self.write(b'{"_rid":"' + rid.encode() + b'","restored":true}\n')

    @staticmethod
    def settle(request: dict) -> dict:
        """Wait (bounded) until this process has no thread left beyond Python's live ones."""
        deadline = time.monotonic() + min(float(request.get("timeout", 2.0)), 10.0)
        while True:
            tasks = len(os.listdir("/proc/self/task"))
            if tasks <= threading.active_count() or time.monotonic() > deadline:
                settled = tasks <= threading.active_count()
                return {"settled": settled, "tasks": tasks, "quiet": settled and quiet()}
            time.sleep(0.001)  # an exiting thread gives no event to wait on; its task entry goes

    def handle(self, request: dict) -> dict:
        if request.get("action") == "settle":
            return self.settle(request)
        return self.runtime.handle(request)

    def reply(self, reply: dict) -> None:
        self.write(encode_line(reply))

    def write(self, data: bytes) -> None:
        with self.write_lock:
            n = os.write(self.fd, data)
            if n < len(data):  # a long reply: the port took part of it
                view = memoryview(data)[n:]
                while view:
                    n = os.write(self.fd, view)
                    view = view[n:]

    def open_session(self, request: dict) -> None:
        sid = str(request.get("_sid"))
        old = self.sessions.pop(sid, None)
        if old is not None:
            old.close()
        session = Session(self.runtime, lambda event: self.reply({**event, "_sid": sid}))
        try:
            hello = self.runtime.start_session(request, session)
        except Exception as exc:  # noqa: BLE001
            hello = error_content(exc)
        else:
            self.sessions[sid] = session
        session.emit({"type": "session_reply", "content": hello}, request.get("id"))

    def session_message(self, message: dict) -> None:
        sid = str(message.pop("_sid"))
        session = self.sessions.get(sid)
        if message.get("type") == "close":
            if session is not None:
                self.sessions.pop(sid, None)
                session.close()
        elif session is not None:
            session.handle(message)
        else:
            with contextlib.suppress(OSError):
                self.reply({"_sid": sid, "type": "session_closed", "id": message.get("id"),
                            "content": {"status": "error", "evalue": f"no session {sid} in this VM"}})

    def serve_one(self, request) -> None:
        rid = None
        try:
            if not isinstance(request, dict):
                raise ValueError("request must be a JSON object")
            rid = request.pop("_rid", None)
            reply = self.handle(request)
        except Exception as exc:  # noqa: BLE001
            reply = {"error": f"{type(exc).__name__}: {exc}", "exit_code": 1}
        if rid is not None:
            reply["_rid"] = rid
        try:
            self.reply(reply)
        except OSError:
            pass  # the host went away; it will not wait for this reply

    def serve_forever(self) -> None:
        buf = bytearray()
        # One buffer for every read: os.read(fd, big) would mmap, mremap and munmap per call, and
        # after a restore each of those kernel paths is translated again.
        chunk = bytearray(1 << 16)
        idle = 0.001
        while True:
            try:
                n = os.readv(self.fd, [chunk])
            except InterruptedError:
                continue
            data = memoryview(chunk)[:n]
            if not n:
                # No host is connected: the port reads EOF until one is. Drop any partial line.
                buf.clear()
                time.sleep(idle)
                idle = min(idle * 2, 0.05)
                continue
            idle = 0.001
            buf += data
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    if len(buf) > MAX_LINE:
                        buf.clear()
                    break
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                if line.startswith(RESTORE):
                    self.serve_restore(line)  # first after a restore: on this thread, no JSON
                    continue
                if not line.strip():
                    continue
                try:
                    request = json.loads(line)
                except ValueError as exc:
                    request = exc
                if isinstance(request, dict) and "_sid" in request:
                    if request.get("action") == "session":  # starting IPython may take a while
                        threading.Thread(target=self.open_session, args=(request,), name="forkd-session",
                                         daemon=True).start()
                    else:
                        self.session_message(request)  # quick: hands it to the main thread or a queue
                elif isinstance(request, dict) and request.get("action") in INLINE:
                    self.serve_one(request)  # quick and first after a restore: no thread start
                elif isinstance(request, Exception):
                    self.reply({"error": f"{type(request).__name__}: {request}", "exit_code": 1})
                else:
                    threading.Thread(target=self.serve_one, args=(request,), name="forkd-request",
                                     daemon=True).start()


def main() -> int:
    path = find_port()
    fd = os.open(path, os.O_RDWR)
    runtime = Runtime({"role": "vm"})
    if os.getpid() == 1:
        children.install()  # reap orphans, never a status the user's code waits for
    # User code runs on the main thread (so an interrupt is a KeyboardInterrupt); the port is read
    # on another.
    runtime.executor = Executor()
    print(f"forkd agent: serving on {path}", file=sys.stderr, flush=True)
    threading.Thread(target=SerialAgent(fd, runtime).serve_forever, name="forkd-serial", daemon=True).start()
    runtime.executor.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
