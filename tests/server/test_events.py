"""/v1/events (server-sent events) and the same changes on jupyter_server's event bus."""

from __future__ import annotations

import asyncio
import json

from forkd_server.app import EVENT_SCHEMA_ID


async def _open_sse(port: int, path: str, headers: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{head}\r\n".encode())
    await writer.drain()
    status = await reader.readline()
    assert b" 200 " in status, status
    while (await reader.readline()).strip():  # response headers
        pass
    return reader, writer


async def _next_events(reader, want: int, timeout: float = 20) -> list[dict]:
    """Read chunked SSE frames until ``want`` data events arrived."""
    events: list[dict] = []

    async def read():
        while len(events) < want:
            line = await reader.readline()
            assert line, "the event stream closed"
            line = line.strip()
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))

    await asyncio.wait_for(read(), timeout)
    return events


async def test_sse_stream_reports_changes(jp_fetch, forkd_app, jp_http_port, jp_base_url, jp_auth_header):
    reader, writer = await _open_sse(jp_http_port, f"{jp_base_url}forkd/v1/events", jp_auth_header)
    try:
        ctl = forkd_app.controller
        await asyncio.to_thread(ctl.create_snapshot, "ev", setup="a = 1")
        kids = await asyncio.to_thread(ctl.spawn, "ev", 1)
        await asyncio.to_thread(ctl.branch, kids[0]["id"], "ev-b", mode="live", wait=False)
        await asyncio.to_thread(ctl.kill_sandbox, kids[0]["id"])
        events = await _next_events(reader, 6)
    finally:
        writer.close()
    seen = [(e["kind"], e["action"], e.get("tag") or e.get("id"), e.get("status")) for e in events]
    assert seen[:2] == [("snapshot", "created", "ev", "writing"), ("snapshot", "status", "ev", "ready")]
    assert ("sandbox", "created", kids[0]["id"], "running") in seen
    assert ("snapshot", "created", "ev-b", "writing") in seen
    assert ("snapshot", "status", "ev-b", "ready") in seen
    assert ("sandbox", "killed", kids[0]["id"], None) in seen
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)


async def test_sse_needs_a_token(jp_fetch, forkd_app):
    r = await jp_fetch("forkd", "v1", "events", headers={"Authorization": ""}, raise_error=False)
    assert (r.code, json.loads(r.body)) == (401, {"error": "missing bearer token"})


async def test_client_disconnect_unsubscribes(jp_fetch, forkd_app, jp_http_port, jp_base_url, jp_auth_header):
    reader, writer = await _open_sse(jp_http_port, f"{jp_base_url}forkd/v1/events", jp_auth_header)
    await reader.readline()  # the chunk with the ": forkd events" comment
    assert len(forkd_app.events.queues) == 1
    writer.close()
    for _ in range(200):  # bounded: the server notices the close on its next loop turn
        if not forkd_app.events.queues:
            break
        await asyncio.sleep(0.01)
    assert forkd_app.events.queues == set()


async def test_events_reach_jupyter_event_bus(jp_serverapp, forkd_app):
    got: list[dict] = []
    arrived = asyncio.Event()

    async def listener(logger, schema_id, data):
        got.append(data)
        if data.get("kind") == "sandbox":
            arrived.set()

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA_ID, listener=listener)
    ctl = forkd_app.controller
    await asyncio.to_thread(ctl.create_snapshot, "bus", setup=None)
    kid = (await asyncio.to_thread(ctl.spawn, "bus", 1))[0]
    await asyncio.wait_for(arrived.wait(), 10)
    assert {"kind": "snapshot", "action": "status", "tag": "bus", "status": "ready"}.items() <= got[1].items()
    assert any(d.get("id") == kid["id"] and d["action"] == "created" for d in got)
