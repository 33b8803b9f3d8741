"""The agent's serving loop: line-delimited JSON over a stream socket.

Each line is one request, each reply one line. A connection may carry many requests, and forkd's
own clients (one request, half-close, read to EOF) work unchanged. File descriptors may ride along
with a request (SCM_RIGHTS); engine-specific actions such as spawn and branch use them.
"""

from __future__ import annotations

import array
import contextlib
import errno
import json
import os
import select
import socket
import threading
from typing import Callable

from .runtime import Runtime
from .session import Session, error_content

MAX_LINE = 96 * 1024 * 1024
MAX_FDS = 253  # the kernel's SCM_MAX_FD
PEEK_BYTES = 512  # what the accepting thread looks at to see whether a connection asks only a ping

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
        fds.extend(received_fds(ancdata))
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


def received_fds(ancdata: list) -> list[int]:
    """The descriptors a ``recvmsg`` received (SCM_RIGHTS), now this process's."""
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    return fds


def encode_line(message: dict) -> bytes:
    """One message as it goes on the wire, both ways: compact JSON and a newline."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def send_reply(conn: socket.socket, reply: dict) -> None:
    conn.sendall(encode_line(reply))


class AgentServer:
    """Serve ``runtime`` (plus engine actions) on a listening socket.

    ``threaded``: each connection gets a thread (a sandbox: user code runs on the main thread's
    executor meanwhile), but a ping already waiting when it is accepted is answered on the
    accepting thread, as the serial agent answers it on its reader (``serial.INLINE``); else connections are served one by one on the accepting thread (a frozen
    template, which only spawns). A connection whose first request is ``{"action": "session"}``
    becomes a streaming session (``session.py``) until the client closes it.
    """

    def __init__(self, runtime: Runtime, listener: socket.socket, actions: dict[str, Action] | None = None,
                 threaded: bool = True, tend: tuple[int, Callable[[], None], float] | None = None):
        self.runtime = runtime
        self.listener = listener
        self.actions = dict(actions or {})
        self.threaded = threaded
        # (fd, fn, every): the accepting thread also calls fn() whenever fd is readable, and at least
        # every ``every`` seconds (the orphan reaper's wake-ups: no thread of its own).
        self.tend = tend
        self._conns: set[socket.socket] = set()
        self._held: set[int] = set()  # descriptors received with requests whose actions still run
        self._conns_lock = threading.Lock()

    def agent_fds(self) -> set[int]:
        """The descriptors this server holds (its listener, its connections, descriptors received
        with requests in progress): the agent's, never the user's."""
        with self._conns_lock:
            fds = {c.fileno() for c in self._conns} | set(self._held)
        return {fd for fd in fds | {self.listener.fileno()} if fd >= 0}

    def address(self):
        """The listener's address, which every connection accepted from it bears as its own (how
        the inventory knows a connection in the moment before its thread has recorded it)."""
        return self.listener.getsockname()

    def _hold(self, fds: list[int]) -> None:
        with self._conns_lock:
            self._held.update(fds)

    def _release(self, fds: list[int]) -> None:
        with self._conns_lock:
            self._held.difference_update(fds)

    def dispatch(self, request: dict, fds: list[int]) -> dict:
        action = self.actions.get(request.get("action")) if isinstance(request, dict) else None
        if action is None:
            for fd in fds:
                os.close(fd)
            self._release(fds)
            if not isinstance(request, dict):
                return {"error": "request must be a JSON object", "exit_code": 1}
            return self.runtime.handle(request)
        self._hold(fds)  # held already when they came with a request read by serve_connection
        try:
            return action(request, fds)
        except Exception as exc:  # noqa: BLE001 - answer, never die
            return {"error": f"{type(exc).__name__}: {exc}", "exit_code": 1}
        finally:
            self._release(fds)

    def serve_connection(self, conn: socket.socket) -> None:
        buf = bytearray()
        with self._conns_lock:
            self._conns.add(conn)
        try:
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
                    self._hold(fds)  # the agent's from the moment they arrive, not the user's
                    if request is None:
                        return
                    if isinstance(request, dict) and request.get("action") == "session":
                        for fd in fds:
                            os.close(fd)
                        self._release(fds)
                        self.serve_session(conn, buf, request)
                        return
                    reply = self.dispatch(request, fds)
                    then = reply.pop("_then", None)
                    try:
                        send_reply(conn, reply)
                    except OSError:
                        pass
                    if then is not None:
                        then()
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    def serve_session(self, conn: socket.socket, buf: bytearray, request: dict) -> None:
        """This connection is now a streaming session: lines in are messages, lines out events."""
        conn.settimeout(None)
        session = Session(self.runtime, lambda event: send_reply(conn, event))
        try:
            hello = self.runtime.start_session(request, session)
        except Exception as exc:  # noqa: BLE001
            with contextlib.suppress(OSError):
                send_reply(conn, {"type": "session_reply", "content": error_content(exc)})
            return
        session.emit({"type": "session_reply", "content": hello}, request.get("id"))
        try:
            while not session.closed:
                try:
                    message, fds = recv_request(conn, buf)
                except (ValueError, OSError):
                    return
                for fd in fds:
                    os.close(fd)
                if message is None:
                    return
                session.handle(message)
        finally:
            session.close()

    def serve_forever(self) -> None:
        """Accept connections on this thread, forever."""
        self.listener.setblocking(True)
        poller, listening = None, self.listener.fileno()
        if self.tend is not None:
            poller = select.poll()
            poller.register(listening, select.POLLIN)
            poller.register(self.tend[0], select.POLLIN)
        while True:
            if self.tend is not None and listening not in self._wait(poller):
                continue  # (closed under us, the listener shows too, and accept says so below)
            try:
                conn, _ = self.listener.accept()
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EINVAL):  # closed under us (a fork's child)
                    return
                continue
            if self.threaded:
                if not self._pinged_here(conn):
                    threading.Thread(target=self.serve_connection, args=(conn,), name="forkd-conn",
                                     daemon=True).start()
            else:
                conn.settimeout(60)
                self.serve_connection(conn)

    def _pinged_here(self, conn: socket.socket) -> bool:
        """Answer a connection on the accepting thread if all it asks is a ping that has already
        arrived (the server's health checks, an agent's gathered pings): starting a thread costs
        several times the ping, and under load the accepting thread waited for each to start.
        Nothing here waits: a request still on its way, anything but a ping, or a connection that
        asks on goes to a thread of its own, with nothing but the ping read. True when it is done."""
        try:
            peeked = conn.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            line, newline, _ = peeked.partition(b"\n")
            request = json.loads(line) if newline else None
        except (OSError, ValueError):  # nothing yet, gone, or not JSON: its thread answers or finds out
            return False
        if not isinstance(request, dict) or request.get("action") != "ping":
            return False
        # Not recorded in _conns (no lock taken on this thread): a fork meanwhile knows it as one
        # accepted from our listener (address()), as it knows one whose thread has not recorded it.
        try:
            _, ancdata, _, _ = conn.recvmsg(len(line) + 1, socket.CMSG_SPACE(MAX_FDS * 4))
            for fd in received_fds(ancdata):  # a ping takes none
                os.close(fd)
            conn.sendall(encode_line(self.runtime.handle(request)), socket.MSG_DONTWAIT)  # small: the buffer takes it
        except OSError:  # gone (or, never seen, a full buffer): the client sees no answer, as if it had closed
            conn.close()
            return True
        try:
            if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return False  # another request: its thread serves it
        except BlockingIOError:  # the client's side is still open: a thread waits for what it says next
            return False
        except OSError:
            pass
        conn.close()  # the client half-closed after its ping (as forkd's clients do), or went
        return True

    def _wait(self, poller: select.poll) -> dict[int, int]:
        """Wait for a connection or the tended descriptor, and tend it when due; the events."""
        fd, fn, every = self.tend
        try:
            events = dict(poller.poll(every * 1000))
        except InterruptedError:
            return {}
        if events.get(fd, 0) & select.POLLNVAL:  # closed: nothing to tend any more
            poller.unregister(fd)
            self.tend = None
        elif fd in events or not events:
            with contextlib.suppress(Exception):  # the accepting thread outlives any surprise
                fn()
        return events

    def start(self) -> threading.Thread:
        """Accept connections on a thread of their own (the main thread runs user code)."""
        thread = threading.Thread(target=self.serve_forever, name="forkd-accept", daemon=True)
        thread.start()
        return thread
