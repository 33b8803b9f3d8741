"""Short agent calls from an event loop on kept connections (agent/kept.py), against a real agent
server in this process and against stand-in agents the test drives by hand: the replies and
errors of ``AgentClient.call``, one connection per agent process, replies matched in order."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import threading

import pytest
from forkd_engine.agent.client import AgentClient, AgentUnavailable
from forkd_engine.agent.kept import KeptConnections
from forkd_engine.agent.runtime import Runtime
from forkd_engine.agent.server import AgentServer, encode_line


class CountingListener(socket.socket):
    """A listening socket that counts the connections it accepts."""

    accepted = 0

    def accept(self):
        got = super().accept()
        self.accepted += 1
        return got


def listening(path: str, backlog: int = 8, cls=socket.socket) -> socket.socket:
    s = cls(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(backlog)
    return s


def run(kept: KeptConnections, calls) -> None:
    """``calls()`` on a loop of its own, then its kept connections closed on it."""
    async def then_close() -> None:
        try:
            await calls()
        finally:
            kept.close()
            await asyncio.sleep(0)  # (a transport closes on the loop's next turn)

    asyncio.run(then_close())


@pytest.fixture
def agent(tmp_path, short_dir):
    """A real agent server on a thread: (its socket path, its listener)."""
    rt = Runtime({"id": "sb-test", "lineage": ["snap", "sb-test"]})
    rt.cwd = str(tmp_path)
    path = os.path.join(short_dir, "a.sock")
    listener = listening(path, cls=CountingListener)
    threading.Thread(target=AgentServer(rt, listener).serve_forever, daemon=True).start()
    yield path, listener
    listener.close()


def test_replies_are_calls_and_a_gathered_batch_shares_one_connection(agent):
    path, listener = agent
    kept = KeptConnections()

    async def calls() -> None:
        key = (path, 1, 1)
        assert (await kept.call(key, path, {"action": "ping"}, 30))["pong"] is True
        eval_ = {"action": "eval", "code": "6*7"}
        assert await kept.call(key, path, eval_, 30) == AgentClient(path).call(eval_)
        # pipelined on one connection: each reply is its own request's
        replies = await asyncio.gather(*(kept.call(key, path, {"action": "eval", "code": f"{i}*2"}, 30)
                                         for i in range(50)))
        assert [r["result"] for r in replies] == [str(i * 2) for i in range(50)]
        assert kept.open_count() == 1

    run(kept, calls)
    assert listener.accepted == 2  # the kept connection, and the one AgentClient.call made


def test_errors_are_calls(short_dir):
    """The deadline over the exchange (a TimeoutError its cause, as the server tells a timeout);
    a full listen queue is a ``BlockingIOError`` (``call`` waits for room there), never a wait on
    the loop; no listener is unreachable."""
    kept = KeptConnections()

    async def calls() -> None:
        mute_path = os.path.join(short_dir, "mute.sock")
        with listening(mute_path), pytest.raises(AgentUnavailable, match=r"did not answer within 0\.3 s") as late:
            await kept.call((mute_path, 1, 1), mute_path, {"action": "ping"}, 0.3)
        assert isinstance(late.value.__cause__, TimeoutError)
        full_path = os.path.join(short_dir, "full.sock")
        queued = []
        with listening(full_path, backlog=0):
            while True:  # fill its listen queue
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                queued.append(s)
                try:
                    s.connect(full_path)
                except BlockingIOError:
                    break
            with pytest.raises(BlockingIOError):
                await kept.call((full_path, 1, 1), full_path, {"action": "ping"}, 5)
            for s in queued:
                s.close()
        with pytest.raises(AgentUnavailable, match="unreachable"):
            await kept.call((full_path, 1, 1), full_path, {"action": "ping"}, 5)  # its listener closed

    run(kept, calls)
    assert kept.open_count() == 0


class StandIn:
    """An agent the test drives: it accepts on ``path``, reads request lines and answers when told."""

    def __init__(self, path: str, name: str):
        self.name = name
        self.listener = listening(path)
        self.conns: list[socket.socket] = []

    def accept(self) -> socket.socket:
        self.listener.settimeout(30)
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        self.conns.append(conn)
        return conn

    @staticmethod
    def read_lines(conn: socket.socket, n: int) -> list[dict]:
        data = b""
        while data.count(b"\n") < n:
            chunk = conn.recv(65536)
            assert chunk, "the connection closed"
            data += chunk
        return [json.loads(line) for line in data.splitlines()]

    def answer(self, conn: socket.socket, request: dict) -> None:
        conn.sendall(json.dumps({"agent": self.name, "n": request.get("n")}).encode() + b"\n")

    def die(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_a_late_reply_is_dropped_in_its_turn(short_dir):
    """A call that timed out leaves its place in line: its reply, when it comes, is not the next
    call's."""
    path = os.path.join(short_dir, "slow.sock")
    agent = StandIn(path, "slow")
    kept = KeptConnections()

    async def calls() -> None:
        key = (path, 1, 1)
        with pytest.raises(AgentUnavailable, match="did not answer within"):
            await kept.call(key, path, {"action": "ping", "n": 1}, 0.3)
        conn = await _in_thread(agent.accept)
        second = asyncio.ensure_future(kept.call(key, path, {"action": "ping", "n": 2}, 30))
        requests = await _in_thread(agent.read_lines, conn, 2)
        assert [r["n"] for r in requests] == [1, 2]  # in order, on the one connection
        for request in requests:
            agent.answer(conn, request)
        assert await second == {"agent": "slow", "n": 2}

    try:
        run(kept, calls)
    finally:
        agent.die()


def test_a_long_call_given_up_on_closes_its_connection(short_dir):
    """On a connection that carries one call at a time (``alone``: an eval, an exec), a call whose
    deadline passed, or whose caller was cancelled, closes it: the next call goes on a new one,
    not behind an answer nobody waits for."""
    path = os.path.join(short_dir, "alone.sock")
    agent = StandIn(path, "slow")
    kept = KeptConnections()

    async def calls() -> None:
        key = (path, 1, 1, "long")
        with pytest.raises(AgentUnavailable, match="did not answer within"):
            await kept.call(key, path, {"action": "eval", "n": 1}, 0.3, alone=True)
        first = await _in_thread(agent.accept)
        assert [r["n"] for r in await _in_thread(agent.read_lines, first, 1)] == [1]
        assert kept.open_count() == 0
        second = asyncio.ensure_future(kept.call(key, path, {"action": "eval", "n": 2}, 30, alone=True))
        conn = await _in_thread(agent.accept)
        assert [r["n"] for r in await _in_thread(agent.read_lines, conn, 1)] == [2]  # on a new connection
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert kept.open_count() == 0
        third = asyncio.ensure_future(kept.call(key, path, {"action": "eval", "n": 3}, 30, alone=True))
        conn = await _in_thread(agent.accept)
        agent.answer(conn, (await _in_thread(agent.read_lines, conn, 1))[0])
        assert await third == {"agent": "slow", "n": 3}
        assert kept.open_count() == 1  # an answered call keeps it

    try:
        run(kept, calls)
    finally:
        agent.die()


def test_each_call_ends_at_its_own_deadline_on_one_connection(short_dir):
    """The connection's one timer serves every deadline: a short call sent after a long one ends
    at its own (within the test's generous bound, long before the long one's), the long one is
    still answered, and a call made after the timer fired gets a deadline too."""
    path = os.path.join(short_dir, "deadlines.sock")
    agent = StandIn(path, "slow")
    kept = KeptConnections()

    async def calls() -> None:
        key = (path, 1, 1)
        long = asyncio.ensure_future(kept.call(key, path, {"action": "ping", "n": 1}, 3600))
        short = asyncio.ensure_future(kept.call(key, path, {"action": "ping", "n": 2}, 0.3))
        conn = await _in_thread(agent.accept)
        requests = await _in_thread(agent.read_lines, conn, 2)
        with pytest.raises(AgentUnavailable, match=r"did not answer within 0\.3 s"):
            await asyncio.wait_for(short, 30)
        assert not long.done()
        with pytest.raises(AgentUnavailable, match=r"did not answer within 0\.2 s"):
            await asyncio.wait_for(kept.call(key, path, {"action": "ping", "n": 3}, 0.2), 30)
        requests += await _in_thread(agent.read_lines, conn, 1)
        for request in requests:  # 2 and 3 come after their callers gave up: dropped in their turn
            agent.answer(conn, request)
        assert await long == {"agent": "slow", "n": 1}
        fourth = asyncio.ensure_future(kept.call(key, path, {"action": "ping", "n": 4}, 30))
        agent.answer(conn, (await _in_thread(agent.read_lines, conn, 1))[0])
        assert await fourth == {"agent": "slow", "n": 4}

    try:
        run(kept, calls)
    finally:
        agent.die()


def test_an_encoded_request_goes_as_it_is_and_replies_read_as_json_reads_them(short_dir):
    """A request already encoded (``encode_line``: a ping, encoded once) is sent byte for byte;
    a reply is what ``json.loads`` makes of its line, NaN and integers past 64 bits included."""
    path = os.path.join(short_dir, "raw.sock")
    agent = StandIn(path, "raw")
    kept = KeptConnections()
    line = encode_line({"action": "ping", "n": 1})
    odd = rb'{"x": NaN, "big": 123456789012345678901234567890, "s": "\u00e9t\u00e9"}'

    async def calls() -> None:
        key = (path, 1, 1)
        first = asyncio.ensure_future(kept.call(key, path, line, 30))
        second = asyncio.ensure_future(kept.call(key, path, {"action": "ping", "n": 2}, 30))
        conn = await _in_thread(agent.accept)
        got = await _in_thread(conn.recv, 65536)
        while got.count(b"\n") < 2:
            got += await _in_thread(conn.recv, 65536)
        assert got == line + encode_line({"action": "ping", "n": 2})
        conn.sendall(b'{"pong": true, "n": 1}\n' + odd + b"\n")
        assert await first == {"pong": True, "n": 1}
        reply = await second
        assert math.isnan(reply.pop("x")) and reply == {"big": 123456789012345678901234567890, "s": "\u00e9t\u00e9"}

    try:
        run(kept, calls)
    finally:
        agent.die()


def test_a_connection_ends_with_its_agent_and_another_process_gets_its_own(short_dir):
    """The agent ends during a call: the call fails as on a new connection, the connection is
    dropped. Another agent at the same path (a sandbox woken, its agent a new process) never gets
    the first one's connection, even while that one is still open: each process its own."""
    path = os.path.join(short_dir, "agent.sock")
    first = StandIn(path, "first")
    kept = KeptConnections()

    async def calls() -> None:
        pending = asyncio.ensure_future(kept.call((path, 100, 1), path, {"action": "ping", "n": 1}, 30))
        conn = await _in_thread(first.accept)
        await _in_thread(first.read_lines, conn, 1)
        first.answer(conn, {"n": 1})
        assert await pending == {"agent": "first", "n": 1}
        # the first agent's process still holds its connection when a new process listens at the path
        os.unlink(path)
        second = StandIn(path, "second")
        try:
            pending = asyncio.ensure_future(kept.call((path, 200, 2), path, {"action": "ping", "n": 2}, 30))
            conn2 = await _in_thread(second.accept)
            request = (await _in_thread(second.read_lines, conn2, 1))[0]
            second.answer(conn2, request)
            assert await pending == {"agent": "second", "n": 2}
            assert kept.open_count() == 2
            # the first one's call dies with it
            pending = asyncio.ensure_future(kept.call((path, 100, 1), path, {"action": "ping", "n": 3}, 30))
            await _in_thread(first.read_lines, conn, 1)
            first.die()
            with pytest.raises(AgentUnavailable, match="closed the connection without a reply"):
                await pending
            assert kept.open_count() == 1
        finally:
            second.die()
        deadline = asyncio.get_running_loop().time() + 30
        while kept.open_count():  # the second one's end is seen without a call
            assert asyncio.get_running_loop().time() < deadline, "the ended agent's connection was kept"
            await asyncio.sleep(0.01)

    try:
        run(kept, calls)
    finally:
        first.die()


def test_idle_connections_past_the_bound_are_closed_least_recently_used_first(short_dir):
    agents = []
    for i in range(3):
        rt = Runtime({"id": f"sb-{i}", "lineage": ["snap", f"sb-{i}"]})
        path = os.path.join(short_dir, f"{i}.sock")
        listener = listening(path)
        threading.Thread(target=AgentServer(rt, listener).serve_forever, daemon=True).start()
        agents.append((path, listener))
    kept = KeptConnections(kept=2)

    async def calls() -> None:
        for path, _ in agents:
            assert (await kept.call((path, 1, 1), path, {"action": "ping"}, 30))["sandbox_id"] == \
                f"sb-{os.path.basename(path)[0]}"
        assert kept.open_count() == 2
        lines = kept._by_loop[asyncio.get_running_loop()]
        assert [key[0] for key in lines.open] == [agents[1][0], agents[2][0]]

    try:
        run(kept, calls)
    finally:
        for _, listener in agents:
            listener.close()


def test_past_the_bound_while_all_are_busy_a_new_connection_still_answers(short_dir):
    rt = Runtime({"id": "sb-b", "lineage": ["snap", "sb-b"]})
    free_path = os.path.join(short_dir, "free.sock")
    listener = listening(free_path)
    threading.Thread(target=AgentServer(rt, listener).serve_forever, daemon=True).start()
    busy_path = os.path.join(short_dir, "busy.sock")
    busy = StandIn(busy_path, "busy")
    kept = KeptConnections(kept=1)

    async def calls() -> None:
        waiting = asyncio.ensure_future(kept.call((busy_path, 1, 1), busy_path, {"action": "ping", "n": 1}, 30))
        conn = await _in_thread(busy.accept)
        await _in_thread(busy.read_lines, conn, 1)  # asked, not answered: its connection is busy
        assert (await kept.call((free_path, 1, 1), free_path, {"action": "ping"}, 30))["sandbox_id"] == "sb-b"
        assert kept.open_count() == 2
        busy.answer(conn, {"n": 1})
        assert await waiting == {"agent": "busy", "n": 1}

    try:
        run(kept, calls)
    finally:
        busy.die()
        listener.close()
