"""A small QMP client: commands matched by id, events kept with QEMU's own timestamps."""

from __future__ import annotations

import array
import json
import socket
import time


class QMPError(Exception):
    """QEMU refused a command or the monitor went away."""


class QMP:
    def __init__(self, path: str, timeout: float = 30.0):
        self.path = path
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise QMPError(f"cannot reach QEMU's monitor at {path}: {exc}") from exc
        self.buf = bytearray()
        self.events: list[dict] = []
        self._id = 0
        self.greeting = self._read(timeout)
        self.version = self.greeting.get("QMP", {}).get("version", {})
        self.execute("qmp_capabilities")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "QMP":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QMPError(f"QEMU's monitor did not answer within {timeout:g} s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as exc:
                raise QMPError(f"QEMU's monitor connection failed: {exc}") from exc
            if not data:
                raise QMPError("QEMU's monitor closed the connection (did QEMU exit?)")
            self.buf += data
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf[:] = rest
        return json.loads(line)

    def execute(self, command: str, arguments: dict | None = None, fds: list[int] | None = None,
                timeout: float | None = None):
        self._id += 1
        msg: dict = {"execute": command, "id": self._id}
        if arguments:
            msg["arguments"] = arguments
        data = json.dumps(msg).encode() + b"\n"
        try:
            if fds:
                self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.sendall(data)
        except OSError as exc:
            raise QMPError(f"{command}: QEMU's monitor connection failed: {exc}") from exc
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read(max(0.001, deadline - time.monotonic()))
            if "event" in reply:
                self.events.append(reply)
                continue
            if reply.get("id") != self._id:
                continue
            if "error" in reply:
                raise QMPError(f"{command}: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def wait_event(self, name: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for i, ev in enumerate(self.events):
                if ev["event"] == name:
                    return self.events.pop(i)
            reply = self._read(max(0.001, deadline - time.monotonic()))
            if "event" in reply:
                self.events.append(reply)


def event_time(event: dict) -> float:
    """An event's timestamp (QEMU's wall clock when it happened), in seconds."""
    ts = event["timestamp"]
    return ts["seconds"] + ts["microseconds"] / 1e6
