"""The async SDK's own HTTP/1.1 pool (``client/_http1.py``) against answers forkd serve does not
give but a proxy in front of it may: chunked bodies with trailers, an interim 100, a body up to the
close, ``Connection: close``; a silent server is a ``Timeout``, a closed one ``Dropped``, and
control characters never reach the wire."""

from __future__ import annotations

import asyncio

import pytest

from forkd_server.client._http1 import Dropped, NotConnected, Pool, Timeout


CLOSE = object()  # after this answer, the server closes the connection


async def serving(answers: list):
    """A server that reads one request head per answer (``heads``, None for each new connection)
    and writes the next answer as given (b""
    says nothing and keeps the connection open; None closes it without a word; an answer followed
    by CLOSE is written, then the connection closed)."""
    heads = []

    async def handle(reader, writer):
        heads.append(None)  # a new connection
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            answer = answers.pop(0)
            if answer is None:
                break
            writer.write(answer)
            await writer.drain()
            if answers and answers[0] is CLOSE:
                answers.pop(0)
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, heads


async def test_bodies_of_every_framing_and_what_keeps_the_connection():
    server, heads = await serving([
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Forkd-Hosts-Missing: http://h:1: why\r\n\r\n"
        b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", CLOSE,
        b"HTTP/1.0 200 OK\r\n\r\nup to the close", CLOSE,
    ])
    port = server.sockets[0].getsockname()[1]
    async with server:
        pool = Pool(f"http://127.0.0.1:{port}", 4)
        assert await pool.request("GET", "/a", {"X": "1"}, None, 10) == (200, b"hello", None)
        # the second answer carries a router's header: the hosts its merged list left out
        assert await pool.request("POST", "/b", {}, b"{}", 10) == (200, b"abcde", "http://h:1: why")
        assert await pool.request("DELETE", "/c", {}, None, 10) == (204, b"", None)
        assert len(pool._idle) == 1  # one connection so far, kept
        assert await pool.request("GET", "/d", {}, None, 10) == (404, b"{}", None)
        assert pool._idle == []  # the server said it closes
        assert await pool.request("GET", "/e", {}, None, 10) == (200, b"up to the close", None)
        await pool.aclose()
    assert [head is None for head in heads] == [True, False, False, False, False, True, False]  # two connections
    heads = [head for head in heads if head is not None]
    assert heads[0].startswith(b"GET /a HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX: 1\r\n" % port)
    assert b"Content-Length: 2\r\n" in heads[1] and b"Content-Length" not in heads[2]  # as http.client


async def test_silence_is_a_timeout_a_close_is_dropped_and_nothing_there_is_not_connected():
    server, _ = await serving([b"", None])
    port = server.sockets[0].getsockname()[1]
    async with server:
        pool = Pool(f"http://127.0.0.1:{port}", 2)
        with pytest.raises(Timeout):
            await pool.request("GET", "/silent", {}, None, 0.3)
        with pytest.raises(Dropped):
            await pool.request("GET", "/closed", {}, None, 10)
        await pool.aclose()
    with pytest.raises(NotConnected):
        await Pool("http://127.0.0.1:9", 1).request("GET", "/", {}, None, 5)  # the discard port: nothing listens


async def test_control_characters_never_reach_the_wire():
    pool = Pool("http://127.0.0.1:9", 1)
    with pytest.raises(ValueError, match="request target"):
        await pool.request("GET", "/a b", {}, None, 5)
    with pytest.raises(ValueError, match="header name or value"):
        await pool.request("GET", "/", {"Authorization": "Bearer x\r\nX-Evil: 1"}, None, 5)
