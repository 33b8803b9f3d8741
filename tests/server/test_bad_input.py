"""The audit's bad inputs: each answers a 4xx ``{"error"}`` that says what to do, never a 500 or a hang."""

from __future__ import annotations

import asyncio
import json

import pytest

from .test_api import call, sandbox, snap  # noqa: F401 - fixtures

def nested(depth: int) -> str:
    return '{"snapshot_tag": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize("route,body,status,says", [
    ("sandboxes", nested(1000), 422, "invalid type for field `snapshot_tag`"),  # the audit's 500
    ("sandboxes", nested(100_000), 400, "invalid JSON body: depth limit exceeded"),
    ("sandboxes", '{"snapshot_tag": "py", "n": NaN}', 400, "invalid JSON body"),
    ("sandboxes", '{"snapshot_tag": "py", "memory_limit_mib": 9223372036854775808}', 400,
     "`memory_limit_mib` must be at most 1048576"),
    ("sandboxes", '{"snapshot_tag": "py", "n": 9223372036854775808}', 400, "n must be between 1 and 1000"),
    ("sandboxes", '{"snapshot_tag": "py", "n": 18446744073709551616}', 400, "n must be between 1 and 1000"),
    ("sandboxes", '{"snapshot_tag": "py", "n": 2.5}', 422, "expected integer"),
    ("snapshots", '{"tag": "m", "mem_size_mib": 9223372036854775808}', 400, "mem_size_mib must be between"),
    ("workspaces", '{"name": "w", "snapshot_tag": "py", "memory_limit_mib": 1e300}', 400, "at most 1048576"),
    ("{sb}/exec", '{"args": ["true"], "timeout_secs": NaN}', 400, "invalid JSON body"),
    ("{sb}/exec", '{"args": ["true"], "timeout_secs": Infinity}', 400, "invalid JSON body"),
    ("{sb}/exec", '{"args": ["true"], "timeout_secs": 1e308}', 400,
     "`timeout_secs` must be more than 0 and at most 86400"),
    ("{sb}/exec", '{"args": ["true"], "timeout_secs": -1}', 400, "`timeout_secs` must be more than 0"),
    ("{sb}/exec", '{"args": ["true"], "timeout_secs": 0}', 400, "`timeout_secs` must be more than 0"),
    ("{sb}/run", '{"code": "1", "timeout": -1}', 400, "`timeout` must be more than 0"),
    ("{sb}/run", '{"code": "1", "timeout": 0}', 400, "`timeout` must be more than 0"),
    ("{sb}/run", '{"code": "1", "timeout": 1e999}', 400, "invalid JSON body"),
    ("{sb}/run", '{"code": "1", "timeout": 90000}', 400, "at most 86400"),
], ids=lambda v: v[:40] if isinstance(v, str) else str(v))
async def test_bad_bodies(jp_fetch, sandbox, route, body, status, says):  # noqa: F811
    parts = ["sandboxes", *route.format(sb=sandbox["id"]).split("/")] if route.startswith("{") else [route]
    code, reply = await call(jp_fetch, "POST", *parts, body=body)
    assert code == status and says in reply["error"], (code, reply)
    assert set(reply) == {"error"}


async def test_bodies_past_the_limit_are_413(jp_fetch, sandbox):  # noqa: F811
    big = b"x" * (100 << 20)  # 100 MiB: read and dropped, never kept
    code, reply = await call(jp_fetch, "PUT", "sandboxes", sandbox["id"], "files", body=big,
                             params={"path": "/tmp/big"})
    assert code == 413 and "more than the 67108864 this route takes" in reply["error"]
    assert reply["limit_bytes"] == 64 << 20
    code, reply = await call(jp_fetch, "POST", "snapshots", body=b'{"tag": "b", "setup": "' + big[:20 << 20] + b'"}')
    assert code == 413 and reply["limit_bytes"] == 16 << 20
    # the connection and the sandbox are fine afterwards
    code, reply = await call(jp_fetch, "PUT", "sandboxes", sandbox["id"], "files", body=b"ok",
                             params={"path": "/tmp/small"})
    assert code == 200 and reply["size"] == 2


async def test_files_refuses_what_is_not_a_regular_file(jp_fetch, sandbox):  # noqa: F811
    sid = sandbox["id"]
    code, out = await call(jp_fetch, "POST", "sandboxes", sid, "exec", body={"args": ["mkfifo", "/tmp/fifo"]})
    assert (code, out["exit_code"]) == (200, 0)
    # a FIFO nobody writes would block the read forever (the audit: a 500 after 30 s)
    code, reply = await call(jp_fetch, "GET", "sandboxes", sid, "files", params={"path": "/tmp/fifo"})
    assert code == 400 and "/tmp/fifo is a FIFO, not a regular file" in reply["error"] and "exec" in reply["error"]
    code, reply = await call(jp_fetch, "PUT", "sandboxes", sid, "files", body=b"x", params={"path": "/tmp/fifo"})
    assert code == 400 and "is a FIFO" in reply["error"]
    code, reply = await call(jp_fetch, "GET", "sandboxes", sid, "files", params={"path": "/dev/zero"})
    assert code == 400 and "/dev/zero is a device" in reply["error"]
    code, reply = await call(jp_fetch, "GET", "sandboxes", sid, "files", params={"path": "/tmp"})
    assert code == 200 and "fifo" in [e["name"] for e in reply["entries"]]  # a directory is still listed


async def test_a_call_racing_a_kill_is_410_not_500(jp_fetch, forkd_app, sandbox):  # noqa: F811
    sid = sandbox["id"]
    running = asyncio.ensure_future(call(jp_fetch, "POST", "sandboxes", sid, "exec",
                                         body={"args": ["sleep", "600"], "timeout_secs": 900}))
    for _ in range(2000):  # readiness: the exec holds the sandbox's lane
        if sid in forkd_app.admission.lanes:
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the exec never started")
    assert (await call(jp_fetch, "DELETE", "sandboxes", sid))[0] == 204
    code, reply = await running
    assert code == 410 and f"sandbox {sid} was killed during this call (an exec)" in reply["error"]
    code, reply = await call(jp_fetch, "POST", "sandboxes", sid, "exec", body={"args": ["true"]})
    assert code == 404 and reply["error"] == f"sandbox {sid} not found: it was killed (DELETE /v1/sandboxes/{sid})"
    assert reply["details"]["ended_at"].endswith(" UTC")
    assert reply["ended"]["reason"] == f"it was killed (DELETE /v1/sandboxes/{sid})"


async def test_a_kill_says_why_when_its_caller_does(jp_fetch, forkd_app, snap):  # noqa: F811
    """``?reason=`` (a router's promote passes it) is what the 404 says afterwards; a reason that is
    not one printable line is refused before anything is killed."""
    sid = forkd_app.controller.spawn("py", 1)[0]["id"]
    for bad, says in (("two\nlines", "invalid query parameter reason='two\\nlines'"), ("x" * 301, "1 to 300"),
                      ("tab\there", "no control characters")):
        code, reply = await call(jp_fetch, "DELETE", "sandboxes", sid, params={"reason": bad})
        assert code == 400 and says in reply["error"], reply
    assert (await call(jp_fetch, "GET", "sandboxes", sid))[0] == 200  # still running
    why = "it lost fork tree ft-0123456789 to sb-1-2, which was promoted"
    assert (await call(jp_fetch, "DELETE", "sandboxes", sid, params={"reason": why}))[0] == 204
    code, reply = await call(jp_fetch, "GET", "sandboxes", sid)
    assert code == 404 and reply["error"] == f"sandbox {sid} not found: {why}" and reply["ended"]["reason"] == why


async def test_nested_session_message_is_an_error_reply(jp_fetch, jp_ws_fetch, sandbox):  # noqa: F811
    ws = await jp_ws_fetch("forkd", "v1", "sandboxes", sandbox["id"], "session")
    try:
        hello = json.loads(await ws.read_message())
        assert hello["type"] == "session_reply"
        await ws.write_message("[" * 100_000 + "]" * 100_000)
        reply = json.loads(await ws.read_message())
        assert reply["type"] == "error_reply" and reply["content"]["ename"] == "JSONDecodeError"
    finally:
        ws.close()


async def test_a_run_past_its_timeout_is_interrupted_not_a_500(jp_fetch, sandbox):  # noqa: F811
    sid = sandbox["id"]
    # 2 s: a run may wait half its timeout for the main thread to take the cell (else a 409, busy);
    # 0.25 s of it was too little on a loaded host for an idle sandbox's hand-over
    code, reply = await call(jp_fetch, "POST", "sandboxes", sid, "run",
                             body={"code": "import time\nwhile True: time.sleep(0.01)", "timeout": 2})
    assert code == 200 and reply["timed_out"] is True and reply["exit_code"] == 1
    assert reply["error"]["ename"] == "TimeoutError" and "was interrupted" in reply["error"]["evalue"]
    code, reply = await call(jp_fetch, "POST", "sandboxes", sid, "run", body={"code": "6 * 7"})
    assert code == 200 and reply["result"] == {"text/plain": "42"}  # the sandbox is free again
