"""The agent's transport inside a VM: line-delimited JSON over a virtio-serial port.

The host keeps one connection to the port and may have several requests in flight: each request
carries ``_rid`` and its reply echoes it, so a reply that outlives its caller (a long ``run_code`` in
a VM that was branched meanwhile) is recognised and dropped by the host. Every request runs in its
own thread; replies are written whole under a lock.

One VM-only action lives here, ``restore``: run first after every restore from a snapshot, before the
host lets anyone else talk to the child. It credits host entropy to the guest kernel and forces a
CRNG reseed, steps the wall clock to the host's, reseeds Python's generators and takes the child's
identity. A child whose ``restore`` failed is never handed out (the host fails closed).

Run as ``python3 -m forkd_engine.agent.serial`` (the guest's /init does).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import struct
import sys
import threading
import time

from .runtime import Runtime, reseed_random_generators
from .server import MAX_LINE, install_reaper

PORT_NAME = "agent"
INLINE = ("ping", "restore")  # answered on the reader thread; everything else gets its own thread
RNDADDENTROPY = 0x40085203   # _IOW('R', 0x03, int[2])
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


def add_entropy(seed: bytes) -> None:
    """Mix ``seed`` into the kernel pool, credit it, and reseed the CRNG now."""
    fd = os.open("/dev/random", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


class SerialAgent:
    def __init__(self, fd: int, runtime: Runtime):
        self.fd = fd
        self.runtime = runtime
        self.write_lock = threading.Lock()
        self.restores = 0

    def restore(self, request: dict) -> dict:
        seed = base64.b64decode(request.get("entropy_b64", ""))
        if len(seed) < 32:
            return {"error": "restore needs at least 32 bytes of entropy", "exit_code": 1}
        add_entropy(seed)
        stepped = 0.0
        host_time = request.get("time")
        if isinstance(host_time, (int, float)):
            stepped = host_time - time.time()
            if abs(stepped) > float(request.get("max_drift", 0.5)):
                time.clock_settime(time.CLOCK_REALTIME, host_time)
        identity = request.get("identity") or {}
        self.runtime.after_fork(identity)
        reseed_random_generators()
        hostname = identity.get("hostname")
        if isinstance(hostname, str) and hostname:
            with open("/proc/sys/kernel/hostname", "w") as f:
                f.write(hostname[:64])
        self.restores += 1
        return {"restored": True, "clock_step_s": round(stepped, 3), "restores": self.restores,
                "identity": self.runtime.identity}

    def handle(self, request: dict) -> dict:
        if request.get("action") == "restore":
            try:
                return self.restore(request)
            except Exception as exc:  # noqa: BLE001 - the host fails closed on an error reply
                return {"error": f"{type(exc).__name__}: {exc}", "exit_code": 1}
        return self.runtime.handle(request)

    def reply(self, reply: dict) -> None:
        data = json.dumps(reply, separators=(",", ":")).encode() + b"\n"
        with self.write_lock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]

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
        idle = 0.001
        while True:
            try:
                data = os.read(self.fd, 1 << 20)
            except InterruptedError:
                continue
            if not data:
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
                if not line.strip():
                    continue
                try:
                    request = json.loads(line)
                except ValueError as exc:
                    request = exc
                if isinstance(request, dict) and request.get("action") in INLINE:
                    self.serve_one(request)  # quick and first after a restore: no thread start
                elif isinstance(request, Exception):
                    self.reply({"error": f"{type(request).__name__}: {request}", "exit_code": 1})
                else:
                    threading.Thread(target=self.serve_one, args=(request,), daemon=True).start()


def main() -> int:
    path = find_port()
    fd = os.open(path, os.O_RDWR)
    runtime = Runtime({"role": "vm"})
    if os.getpid() == 1:
        install_reaper(lambda pid: pid in runtime.procs, guard=runtime.procs_lock)
    print(f"forkd agent: serving on {path}", file=sys.stderr, flush=True)
    SerialAgent(fd, runtime).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
