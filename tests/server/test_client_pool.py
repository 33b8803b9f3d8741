"""The SDK's kept-alive connections, sync and async, against a stand-in server that misbehaves on
purpose: it closes idle connections, or drops a request without answering it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from forkd_server.client import AsyncController, Controller, ServerUnreachable


class Flaky(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless told otherwise
    seen: list[tuple[str, str, int]] = []  # (method, path, client port)
    drop_next = 0            # answer nothing to this many requests (close the connection instead)
    close_after_answer = False  # close each connection after its answer, saying nothing (an idle timeout)

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        Flaky.seen.append((self.command, self.path, self.client_address[1]))
        if Flaky.drop_next:
            Flaky.drop_next -= 1
            self.close_connection = True
            return
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if Flaky.close_after_answer:
            self.close_connection = True

    do_GET = do_POST = do_DELETE = do_PUT = _handle

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    closed = 0  # connections this server has closed

    def shutdown_request(self, request):
        super().shutdown_request(request)
        Server.closed += 1


def closed(n: int, timeout: float = 10) -> None:
    """Wait until the server has closed ``n`` connections (an idle timeout that has struck)."""
    deadline = time.monotonic() + timeout
    while Server.closed < n:
        assert time.monotonic() < deadline, f"the server closed {Server.closed} connections, not {n}"
        time.sleep(0.001)


def tcp_to(port: int) -> list[tuple[int, str]]:
    """This process's TCP sockets whose remote port is ``port``: (local port, state as /proc writes
    it: "01" established), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == port:
                    found.append((int(local.rsplit(":", 1)[1], 16), state))
    return found


def our_sockets(port: int) -> int:
    """This process's TCP sockets to ``port``, in any state."""
    return len(tcp_to(port))


async def aclosed(n: int, port: int, timeout: float = 10) -> None:
    """``closed``, and then until the event loop has seen it too (aiohttp dropped the socket)."""
    deadline = time.monotonic() + timeout
    while Server.closed < n or our_sockets(port):
        assert time.monotonic() < deadline, "the closed connection is still open on our side"
        await asyncio.sleep(0.001)


@pytest.fixture
def flaky():
    Flaky.seen, Flaky.drop_next, Flaky.close_after_answer = [], 0, False
    Server.closed = 0
    server = Server(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_sync_reuses_one_connection(flaky):
    with Controller(flaky, "t") as ctl:
        for _ in range(5):
            assert ctl.ping_sandbox("sb-1") == {"ok": True}
    assert len({port for _m, _p, port in Flaky.seen}) == 1


async def test_async_reuses_its_connections(flaky):
    async with AsyncController(flaky, "t") as ctl:
        for _ in range(5):
            assert await ctl.ping_sandbox("sb-1") == {"ok": True}
    assert len({port for _m, _p, port in Flaky.seen}) == 1


def test_sync_a_connection_the_server_closed_is_not_used(flaky):
    Flaky.close_after_answer = True  # every kept connection is dead by the next call
    with Controller(flaky, "t") as ctl:
        for n in range(3):  # eval is not safe to send twice: it must go out once, on a live connection
            closed(n)
            assert ctl.eval_code("sb-1", "1") == {"ok": True}
    assert [m for m, _p, _port in Flaky.seen] == ["POST"] * 3
    assert len({port for _m, _p, port in Flaky.seen}) == 3


async def test_async_a_connection_the_server_closed_is_not_used(flaky):
    Flaky.close_after_answer = True
    async with AsyncController(flaky, "t") as ctl:
        for n in range(3):
            await aclosed(n, int(flaky.rsplit(":", 1)[1]))
            assert await ctl.eval_code("sb-1", "1") == {"ok": True}
    assert [m for m, _p, _port in Flaky.seen] == ["POST"] * 3


def test_sync_retries_what_is_safe_to_repeat_and_nothing_else(flaky):
    with Controller(flaky, "t") as ctl:
        Flaky.drop_next = 1
        assert ctl.list_sandboxes() == {"ok": True}  # GET: dropped once, sent again
        assert [m for m, _p, _port in Flaky.seen] == ["GET", "GET"]
        Flaky.seen.clear()
        Flaky.drop_next = 1
        with pytest.raises(ServerUnreachable) as info:
            ctl.eval_code("sb-1", "x += 1")  # not safe to run twice: reported, not repeated
        assert "no forkd server answers" in str(info.value)
        assert [m for m, _p, _port in Flaky.seen] == ["POST"]
        Flaky.seen.clear()
        Flaky.drop_next = 2  # more drops than retries: reported
        with pytest.raises(ServerUnreachable):
            ctl.ping_sandbox("sb-1")
        assert len(Flaky.seen) == 2


async def test_async_retries_what_is_safe_to_repeat_and_nothing_else(flaky):
    async with AsyncController(flaky, "t") as ctl:
        Flaky.drop_next = 1
        assert await ctl.list_sandboxes() == {"ok": True}
        assert [m for m, _p, _port in Flaky.seen] == ["GET", "GET"]
        Flaky.seen.clear()
        Flaky.drop_next = 1
        with pytest.raises(ServerUnreachable):
            await ctl.eval_code("sb-1", "x += 1")
        assert [m for m, _p, _port in Flaky.seen] == ["POST"]


def test_a_forked_process_opens_its_own_connection(flaky):
    ctl = Controller(flaky, "t")
    ctl.ping_sandbox("sb-1")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its calls must not go over the parent's socket
        try:
            ok = ctl.ping_sandbox("sb-1") == {"ok": True}
        except BaseException:  # noqa: BLE001 - reported through the pipe
            ok = False
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read)
    ctl.ping_sandbox("sb-1")
    ports = [port for _m, _p, port in Flaky.seen]
    assert ports[0] == ports[2] != ports[1]  # the parent kept its connection; the child had its own
    ctl.close()
