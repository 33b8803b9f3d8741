"""Talk to a guest agent over a Unix stream socket."""

from __future__ import annotations

import array
import json
import socket
import threading

from .server import MAX_LINE, encode_line


class AgentUnavailable(OSError):
    """The agent could not be reached or did not answer."""


class AgentClient:
    def __init__(self, path: str, timeout: float = 30.0):
        self.path = path
        self.timeout = timeout

    def call(self, request: dict, fds: list[int] | None = None, timeout: float | None = None) -> dict:
        """Send one request (with optional fds) and return the agent's reply."""
        deadline = self.timeout if timeout is None else timeout
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(deadline)
                s.connect(self.path)
                data = encode_line(request)
                if fds:
                    s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                else:
                    s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                chunks = []
                size = 0
                while True:
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_LINE:
                        raise AgentUnavailable(f"agent reply larger than {MAX_LINE} bytes")
                    if chunk.endswith(b"\n"):
                        break
        except socket.timeout as exc:
            raise AgentUnavailable(f"agent at {self.path} did not answer within {deadline:g} s") from exc
        except OSError as exc:
            if isinstance(exc, AgentUnavailable):
                raise
            raise AgentUnavailable(f"agent at {self.path} unreachable: {exc.strerror or exc}") from exc
        return self._reply(chunks)

    def _reply(self, chunks: list[bytes]) -> dict:
        raw = b"".join(chunks)
        if not raw.strip():
            raise AgentUnavailable(f"agent at {self.path} closed the connection without a reply")
        return json.loads(raw)


class AgentSession:
    """A streaming session on its own connection: ``{"action": "session"}`` first, then line-JSON
    messages out and events in (see ``agent/session.py``). Thread-safe ``send``; one reader."""

    def __init__(self, path: str, request: dict, connect_timeout: float = 10.0):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = bytearray()
        self._send_lock = threading.Lock()
        self.closed = False
        try:
            self._sock.settimeout(connect_timeout)
            self._sock.connect(path)
            self._sock.settimeout(None)
        except OSError as exc:
            self._sock.close()
            raise AgentUnavailable(f"agent at {path} unreachable: {exc.strerror or exc}") from exc
        self.send({**request, "action": "session"})

    def send(self, message: dict) -> None:
        data = encode_line(message)
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            raise AgentUnavailable(f"agent session at {self.path} closed: {exc.strerror or exc}") from exc

    def recv(self, timeout: float | None = None) -> dict | None:
        """The next event; None when the agent ended the session. ``TimeoutError`` after ``timeout``."""
        while b"\n" not in self._buf:
            self._sock.settimeout(timeout)
            try:
                chunk = self._sock.recv(1 << 20)
            except socket.timeout:
                raise TimeoutError(f"no event from the agent within {timeout:g} s") from None
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk
            if len(self._buf) > MAX_LINE:
                raise AgentUnavailable(f"agent event larger than {MAX_LINE} bytes")
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf[:] = rest
        return json.loads(line)

    def close(self) -> None:
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
