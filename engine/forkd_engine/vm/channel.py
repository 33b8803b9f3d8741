"""The host side of the agent channel: one Unix socket per VM (QEMU's end of the guest's
virtio-serial port), carrying line-delimited JSON requests matched by ``_rid`` and streaming sessions
multiplexed by ``_sid``, plus the plain-text ``restore`` line sent first after every restore.

Its own room because it is the wire protocol to the guest agent (``forkd_engine.agent.serial`` is the
other end): nothing here knows QEMU, snapshots or the engine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import secrets
import socket
import threading
import time

from ..agent.server import encode_line
from ..base import AgentUnreachable


class AgentChannel:
    """One connection to a VM's agent port, many requests in flight (matched by ``_rid``)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise AgentUnreachable(f"agent port {path} unreachable: {exc}") from exc
        self.token = secrets.token_hex(4)   # a child's inherited in-flight replies never match
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.pending: dict[str, list] = {}
        self.sessions: dict[str, queue.Queue] = {}  # streaming sessions on this port, by _sid
        self.error: str | None = None
        threading.Thread(target=self._reader, name="vm-agent-reader", daemon=True).start()

    def _reader(self) -> None:
        buf = bytearray()
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except OSError as exc:
                data, why = b"", str(exc)
            else:
                why = "the VM's agent port closed (did QEMU exit?)"
            if not data:
                self._fail(why)
                return
            buf += data
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue
                if isinstance(reply, dict) and "_sid" in reply:
                    with self.lock:
                        events = self.sessions.get(reply.pop("_sid"))
                    if events is not None:
                        events.put(reply)
                    continue
                rid = reply.pop("_rid", None) if isinstance(reply, dict) else None
                with self.lock:
                    slot = self.pending.pop(rid, None)
                if slot is not None:
                    slot[1] = reply
                    slot[0].set()

    def _fail(self, why: str) -> None:
        with self.lock:
            self.error = why
            slots, self.pending = list(self.pending.values()), {}
            sessions, self.sessions = list(self.sessions.values()), {}
        for slot in slots:
            slot[0].set()
        for events in sessions:
            events.put(None)

    @property
    def broken(self) -> bool:
        return self.error is not None

    def send(self, request) -> list:
        """Send without waiting; returns the slot ``wait`` takes. ``request`` is a dict (sent as JSON)
        or a function of the request id returning the whole line (the restore line)."""
        rid = f"{self.token}-{next(self.ids)}"
        slot = [threading.Event(), None, rid]
        with self.lock:
            if self.error:
                raise AgentUnreachable(self.error)
            self.pending[rid] = slot
        self._send_line(request(rid) if callable(request) else encode_line({**request, "_rid": rid}))
        return slot

    def wait(self, slot: list, timeout: float) -> dict:
        if not slot[0].wait(timeout):
            with self.lock:
                self.pending.pop(slot[2], None)
            raise AgentUnreachable(f"the VM's agent did not answer within {timeout:g} s")
        if slot[1] is None:
            raise AgentUnreachable(self.error or "the VM's agent went away")
        return slot[1]

    def call(self, request: dict, timeout: float = 30.0) -> dict:
        return self.wait(self.send(request), timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def write(self, message: dict) -> None:
        self._send_line(encode_line(message))

    def _send_line(self, data: bytes) -> None:
        try:
            with self.send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            self._fail(str(exc))
            raise AgentUnreachable(f"agent port write failed: {exc}") from exc

    def open_session(self, options: dict) -> "VMSession":
        sid = f"{self.token}-s{next(self.ids)}"
        events: queue.Queue = queue.Queue()
        with self.lock:
            if self.error:
                raise AgentUnreachable(self.error)
            self.sessions[sid] = events
        self.write({**options, "action": "session", "_sid": sid})
        return VMSession(self, sid, events)


class VMSession:
    """A streaming session multiplexed on a VM's agent port (its lines carry ``_sid``)."""

    def __init__(self, channel: AgentChannel, sid: str, events: queue.Queue):
        self.channel, self.sid, self.events = channel, sid, events
        self.closed = False

    def send(self, message: dict) -> None:
        if self.closed:
            raise AgentUnreachable("the session is closed")
        self.channel.write({**message, "_sid": self.sid})

    def recv(self, timeout: float | None = None) -> dict | None:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no event from the VM's agent within {timeout:g} s") from None
        if event is None:
            self.closed = True
        return event

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self.channel.lock:
            self.channel.sessions.pop(self.sid, None)
        with contextlib.suppress(AgentUnreachable):
            self.channel.write({"_sid": self.sid, "type": "close"})
        self.events.put(None)


def restore_request(identity: dict):
    """The agent's ``restore`` line (``forkd_engine.agent.serial.parse_restore``): plain text, so
    a fresh child answers it without running (and translating) a JSON decoder first."""
    name = re.sub(r"[^A-Za-z0-9-]", "-", str(identity.get("id", "forkd")))[-63:].strip("-") or "forkd"
    texts = (str(identity.get("id", "")), str(identity.get("role", "")), name,
             "\n".join(str(t) for t in identity.get("lineage") or []))
    tail = "%s %d %s\n" % (os.urandom(64).hex(), time.time_ns(), " ".join(t.encode().hex() for t in texts))
    return lambda rid: f"restore {rid} {tail}".encode()
