"""Talk to a guest agent over a Unix stream socket."""

from __future__ import annotations

import array
import json
import socket

from .server import MAX_LINE


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
                data = json.dumps(request, separators=(",", ":")).encode() + b"\n"
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
        raw = b"".join(chunks)
        if not raw.strip():
            raise AgentUnavailable(f"agent at {self.path} closed the connection without a reply")
        return json.loads(raw)
