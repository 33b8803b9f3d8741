"""The agent's serving loop: line-delimited JSON over a stream socket.

Each line is one request, each reply one line. A connection may carry many requests, and forkd's
own clients (one request, half-close, read to EOF) work unchanged. File descriptors may ride along
with a request (SCM_RIGHTS); engine-specific actions such as spawn and branch use them.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import signal
import socket
import threading
from typing import Callable

from .runtime import Runtime

MAX_LINE = 96 * 1024 * 1024
MAX_FDS = 253  # the kernel's SCM_MAX_FD

# An action gets (request, received fds) and returns a reply. A reply may carry "_then", a callable
# run after the reply is on the wire (e.g. exec a reaper once the caller knows it worked).
Action = Callable[[dict, list], dict]


def recv_request(conn: socket.socket, buf: bytearray) -> tuple[dict | None, list[int]]:
    """Read one line (and any fds sent with it). Returns (None, []) on a clean EOF."""
    fds: list[int] = []
    while b"\n" not in buf:
        if len(buf) > MAX_LINE:
            raise ValueError(f"request line longer than {MAX_LINE} bytes")
        data, ancdata, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if not data:
            if buf.strip():
                break  # a last request without its newline (forkd clients half-close)
            for fd in fds:
                os.close(fd)
            return None, []
        buf += data
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line), fds


def send_reply(conn: socket.socket, reply: dict) -> None:
    conn.sendall(json.dumps(reply, separators=(",", ":")).encode() + b"\n")


class AgentServer:
    """Serve ``runtime`` (plus engine actions) on a listening socket."""

    def __init__(self, runtime: Runtime, listener: socket.socket, actions: dict[str, Action] | None = None,
                 threaded: bool = True):
        self.runtime = runtime
        self.listener = listener
        self.actions = dict(actions or {})
        self.threaded = threaded

    def dispatch(self, request: dict, fds: list[int]) -> dict:
        action = self.actions.get(request.get("action")) if isinstance(request, dict) else None
        if action is None:
            for fd in fds:
                os.close(fd)
            if not isinstance(request, dict):
                return {"error": "request must be a JSON object", "exit_code": 1}
            return self.runtime.handle(request)
        try:
            return action(request, fds)
        except Exception as exc:  # noqa: BLE001 - answer, never die
            return {"error": f"{type(exc).__name__}: {exc}", "exit_code": 1}

    def serve_connection(self, conn: socket.socket) -> None:
        buf = bytearray()
        with conn:
            while True:
                try:
                    request, fds = recv_request(conn, buf)
                except (ValueError, json.JSONDecodeError) as exc:
                    with contextlib.suppress(OSError):
                        send_reply(conn, {"error": f"{type(exc).__name__}: {exc}", "exit_code": 1})
                    return
                except OSError:
                    return
                if request is None:
                    return
                reply = self.dispatch(request, fds)
                then = reply.pop("_then", None)
                try:
                    send_reply(conn, reply)
                except OSError:
                    pass
                if then is not None:
                    then()

    def serve_forever(self) -> None:
        sel = selectors.DefaultSelector()
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ)
        while True:
            for _key, _ev in sel.select():
                try:
                    conn, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                conn.setblocking(True)
                if self.threaded:
                    threading.Thread(target=self.serve_connection, args=(conn,), daemon=True).start()
                else:
                    conn.settimeout(60)
                    self.serve_connection(conn)


def reap_children(skip: Callable[[int], bool]) -> list[int]:
    """Reap exited children of this process that nobody else waits for (we may be PID 1)."""
    me = os.getpid()
    reaped = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] == b"Z" and int(fields[1]) == me and not skip(int(name)):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(name), 0)
                reaped.append(int(name))
    return reaped


def install_reaper(skip: Callable[[int], bool], guard: threading.Lock | None = None,
                   on_reaped: Callable[[int], None] = lambda pid: None) -> None:
    """Reap on SIGCHLD. ``guard`` is held while exec children are started: skip that round."""
    def handler(_signum, _frame):
        if guard is not None and not guard.acquire(blocking=False):
            return
        try:
            for pid in reap_children(skip):
                on_reaped(pid)
        finally:
            if guard is not None:
                guard.release()
    signal.signal(signal.SIGCHLD, handler)
