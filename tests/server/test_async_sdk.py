"""The async SDK (``AsyncController``, ``AsyncSandbox``, ``AsyncSnapshot``) through a real ``forkd
serve``: the sync SDK's scenarios (wire, spawn, branch live, eval, streamed cells, interrupts,
files, errors), awaited; cancelling a task interrupts its cell; one controller's pool serves many
concurrent calls over a few kept-alive connections (and the sync controller keeps its one too).

Coroutine tests run under pytest_jupyter's hooks (tests/server/conftest.py), each on a fresh loop,
so each makes its own AsyncController; the module's snapshot is made with the sync SDK.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error

import pytest

from forkd_server.client import (AsyncController, AsyncSandbox, AsyncSnapshot, Controller, ControllerError,
                                 ServerUnreachable, SessionClosed, Snapshot)
from forkd_server.streaming import AsyncSession

from ..signals import signal_report
from .test_client_pool import tcp_to
from .test_client_wire import CASES, Recorder, last, recorder  # noqa: F401 - the recorder fixture


@pytest.fixture(scope="module")
def snap(ctl):
    return Snapshot.create("asyncs", controller=ctl, setup="import os, time\nbase = 41")


def actl(server, **kw) -> AsyncController:
    return AsyncController(server.url, server.token, **kw)


def client_ports(server_port: int) -> set[int]:
    """Local ports of this process's established TCP connections to ``server_port``."""
    return {local for local, state in tcp_to(server_port) if state == "01"}


# --- the wire: the same bytes as the sync SDK (and forkd's) ----------------------------------------

async def test_wire_is_the_sync_sdks(recorder, monkeypatch):  # noqa: F811
    monkeypatch.delenv("FORKD_TOKEN", raising=False)
    sync = Controller(f"http://127.0.0.1:{recorder.server_port}/", token="t0k3n")
    async with AsyncController(f"http://127.0.0.1:{recorder.server_port}/", token="t0k3n") as ctl:
        for fn, method, path, body in [*CASES, (lambda c: c.ping_sandbox("sb-1"), "POST", "/v1/sandboxes/sb-1/ping",
                                                None)]:
            fn(sync)
            want = last()
            await fn(ctl)
            got = last()
            assert (got["method"], got["path"], got["body"]) == (method, path, body or b"")
            for name in ("Authorization", "Content-Type", "Content-Length", "User-Agent", "Accept-Encoding"):
                if name == "Content-Length" and method == "DELETE":  # aiohttp says 0 where urllib says nothing
                    assert got["headers"].get(name) in ("0", None)
                    continue
                assert got["headers"].get(name) == want["headers"].get(name), (path, name)
            assert "Accept" not in got["headers"]
        Recorder.reply = (404, b'{"error": "sandbox sb-x not found"}')
        with pytest.raises(ControllerError) as info:
            await ctl.get_sandbox("sb-x")
        assert info.value.status == 404 and info.value.message == "sandbox sb-x not found"
        assert info.value.url.endswith("/v1/sandboxes/sb-x")
        Recorder.reply = (204, b"")
        assert await ctl.kill_sandbox("sb-1") is None


async def test_unreachable_is_the_same_urlerror():
    async with AsyncController("http://127.0.0.1:9", token=None) as ctl:  # the discard port: nothing listens
        with pytest.raises(ServerUnreachable) as info:
            await ctl.list_sandboxes()
    assert isinstance(info.value, urllib.error.URLError)
    assert "no forkd server answers at http://127.0.0.1:9" in str(info.value) and "forkd serve" in str(info.value)


# --- sandboxes and snapshots ---------------------------------------------------------------------

async def test_spawn_eval_branch_live_and_fork(server, snap):
    async with actl(server) as ctl:
        parent = await AsyncSnapshot.connect(snap.tag, ctl)
        assert parent.tag == "asyncs" and parent.status == "ready"
        async with (await parent.fork(1))[0] as sb:
            assert isinstance(sb, AsyncSandbox) and sb.snapshot_tag == "asyncs"
            assert await sb.eval("base + 1") == "42"
            assert (await sb.run_code("kept = [base] * 3")).error is None
            branch = await sb.branch(mode="live", wait=False)
            assert isinstance(branch, AsyncSnapshot) and branch.branched_from == sb.id
            assert (await branch.wait()).status == "ready"
            kids = await branch.fork(2)
            try:
                assert [await k.eval("kept") for k in kids] == ["[41, 41, 41]"] * 2
                again = await AsyncSandbox.connect(kids[0].id, ctl)
                assert again.info["id"] == kids[0].id
                assert {s.id for s in await AsyncSandbox.list(ctl)} >= {sb.id, *(k.id for k in kids)}
            finally:
                for kid in kids:
                    await kid.kill()
            await branch.delete()
        with pytest.raises(ControllerError) as info:  # the `async with` killed it
            await ctl.get_sandbox(sb.id)
        assert info.value.status == 404
        with pytest.raises(TypeError, match="AsyncSandbox.connect"):
            AsyncSandbox("sb-1", ctl)


async def test_errors_are_the_sync_sdks(server, snap):
    async with actl(server) as ctl:
        with pytest.raises(ControllerError) as info:
            await AsyncSandbox.connect("sb-nope", ctl)
        assert info.value.status == 404 and "sb-nope" in info.value.message
        sb = (await (await AsyncSnapshot.connect("asyncs", ctl)).fork())[0]
        with pytest.raises(RuntimeError, match="forkd eval"):
            await sb.eval("1/0")
        await sb.kill(reason="it lost the race")
        await sb.kill()  # already gone: no error, like the sync kill
        with pytest.raises(ControllerError) as info:
            await ctl.get_sandbox(sb.id)
        assert info.value.message == f"sandbox {sb.id} not found: it lost the race"
    async with AsyncController(server.url, "wrong-token") as bad:
        with pytest.raises(ControllerError) as info:
            await bad.list_sandboxes()
        assert (info.value.status, info.value.body) == (401, {"error": "invalid bearer token"})
        with pytest.raises(ControllerError) as info:
            await AsyncSession(bad, sb.id)
        assert info.value.status == 401 and info.value.message == "invalid bearer token"
    async with actl(server) as ctl:
        with pytest.raises(ControllerError) as info:
            await ctl.session("sb-nope")
        assert info.value.status == 404 and "sb-nope" in info.value.message


# --- cells: streamed, collected, interrupted -------------------------------------------------------

async def test_output_streams_while_the_cell_runs(server, snap):
    # The cell waits for a file the test writes only after it has seen the cell's first line: if
    # output arrived at the end of the cell, this would never finish. The callback is async.
    async with actl(server) as ctl:
        sb = (await AsyncSnapshot(snap.info, ctl).fork())[0]
        seen, lines = [], []

        async def on_stdout(text: str) -> None:
            lines.append(text)
            if "ready" in text:
                await sb.files.write("/tmp/go", "")

        code = ("print('ready', flush=True)\nwhile not os.path.exists('/tmp/go'):\n    time.sleep(0.01)\n"
                "print('done')\nbase + 1")
        execution = await sb.run_code(code, timeout=60, on_stdout=on_stdout, on_event=seen.append)
        assert execution.stdout == "ready\ndone\n" and "".join(lines) == "ready\ndone\n"
        assert execution.text == "42"
        kinds = [e["type"] for e in seen]
        assert kinds.index("stream") < kinds.index("execute_result") and "execute_reply" not in kinds
        await sb.kill()


async def test_run_stream_is_an_async_iterator(server, snap):
    async with actl(server) as ctl:
        sb = (await AsyncSnapshot(snap.info, ctl).fork())[0]
        kinds, texts = [], []
        async for event in sb.run_stream("print('one', flush=True)\nprint('two')\n40 + 2"):
            kinds.append(event["type"])
            texts.append(event.get("text") or (event.get("data") or {}).get("text/plain"))
        assert kinds[-1] == "execute_reply" and "execute_result" in kinds
        assert "".join(t for k, t in zip(kinds, texts) if k == "stream") == "one\ntwo\n" and "42" in texts
        execution = await sb.run_code("print('x', file=__import__('sys').stderr)\nraise ValueError('no')")
        assert execution.stderr == "x\n" and execution.error["ename"] == "ValueError"
        await sb.kill()


async def test_cancelling_the_task_interrupts_the_cell(server, snap):
    async with actl(server) as ctl:
        sb = (await AsyncSnapshot(snap.info, ctl).fork())[0]
        assert (await sb.run_code("x = 21")).error is None
        started = asyncio.Event()
        task = asyncio.create_task(sb.run_code("print('sleeping', flush=True)\ntime.sleep(60)",
                                               on_stdout=lambda text: started.set()))
        await asyncio.wait_for(started.wait(), 30)
        assert (await sb.ping())["busy"]  # the cell runs
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 10  # not the 60 s of the cell
        assert (await sb.ping())["busy"] is None, signal_report(sb.info.get("pid"))  # interrupted, not left running
        assert await sb.eval("x") == "21"  # state kept
        with pytest.raises(asyncio.TimeoutError):  # wait_for cancels the task it gives up on
            await asyncio.wait_for(sb.run_code("time.sleep(60)"), 2)
        assert (await sb.ping())["busy"] is None

        # the same when the task is iterating run_stream
        async def iterate():
            async for event in sb.run_stream("print('again', flush=True)\ntime.sleep(60)"):
                if event.get("type") == "stream":
                    started.set()
        started.clear()
        task = asyncio.create_task(iterate())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await sb.ping())["busy"] is None

        # and when the loop is left early, once the iterator is closed
        stream = sb.run_stream("print('third', flush=True)\ntime.sleep(60)")
        async for event in stream:
            if event.get("type") == "stream":
                break
        await stream.aclose()
        assert (await sb.ping())["busy"] is None
        await sb.kill()


async def test_timeout_interrupts_the_cell(server, snap):
    async with actl(server) as ctl:
        sb = (await AsyncSnapshot(snap.info, ctl).fork())[0]
        execution = await sb.run_code("time.sleep(60)", timeout=1)
        assert execution.error["ename"] == "KeyboardInterrupt"
        assert (await sb.ping())["busy"] is None
        await sb.kill()


async def test_session_input_interrupt_and_a_killed_sandbox(server, snap):
    async with actl(server) as ctl:
        sb = (await AsyncSnapshot(snap.info, ctl).fork())[0]
        prompts = []

        async def answer(prompt: str, password: bool) -> str:
            prompts.append(prompt)
            return "ada"

        async with sb.session() as session:
            reply = await session.execute("name = input('who? ')", input=answer)
            assert reply["status"] == "ok" and prompts == ["who? "]
            started = asyncio.Event()
            running = asyncio.create_task(session.execute("print('s', flush=True)\ntime.sleep(60)",
                                                          on_event=lambda e: started.set()))
            await asyncio.wait_for(started.wait(), 30)
            await session.interrupt()
            reply = await asyncio.wait_for(running, 30)
            assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
        assert await sb.eval("name") == "'ada'"
        session = await ctl.session(sb.id)
        await sb.kill()
        with pytest.raises(SessionClosed):
            await session.request("execute", code="1", timeout=30)
        await session.close()


async def test_rest_interrupt_and_events(server, snap):
    async with actl(server) as ctl:
        sb = (await AsyncSnapshot(snap.info, ctl).fork())[0]
        assert await ctl.interrupt(sb.id) == {"interrupted": False, "running": None}
        run = asyncio.create_task(ctl.run_code(sb.id, "time.sleep(60)"))
        while not (await ctl.ping_sandbox(sb.id))["busy"]:
            pass
        assert (await sb.interrupt())["interrupted"] is True
        assert (await asyncio.wait_for(run, 30))["error"]["ename"] == "KeyboardInterrupt"
        stream = await ctl.events(timeout=20)
        async with stream:
            kid = (await ctl.spawn_sandboxes("asyncs"))[0]
            event = await anext(stream)
            assert (event["kind"], event["action"], event["id"]) == ("sandbox", "created", kid["id"])
            await ctl.kill_sandbox(kid["id"])
            event = await anext(stream)
            assert (event["kind"], event["action"], event["id"]) == ("sandbox", "killed", kid["id"])
        assert stream.closed
        await sb.kill()


async def test_files_and_commands(server, snap):
    async with actl(server) as ctl:
        async with await AsyncSandbox.create("asyncs", controller=ctl) as sb:
            await sb.files.write("/tmp/a.txt", "hello")
            await sb.files.write("/tmp/a.txt", " world", append=True)
            assert await sb.files.read("/tmp/a.txt") == "hello world"
            assert await sb.files.read("/tmp/a.txt", format="bytes") == b"hello world"
            assert "a.txt" in [e["name"] for e in await sb.files.list("/tmp")]
            assert await sb.files.exists("/tmp/a.txt") and not await sb.files.exists("/tmp/nope")
            with pytest.raises(IsADirectoryError):
                await ctl.read_file(sb.id, "/tmp")
            await sb.files.remove("/tmp/a.txt")
            assert not await sb.files.exists("/tmp/a.txt")
            done = await sb.commands.run("echo out; echo err >&2; exit 3")
            assert (done.stdout, done.stderr, done.exit_code) == ("out\n", "err\n", 3)


# --- the pool ------------------------------------------------------------------------------------

async def test_100_concurrent_pings_share_a_few_kept_connections(server, snap):
    sb = snap.fork(1)[0]
    async with actl(server, max_connections=8) as ctl:
        before = client_ports(server.port)
        answers = await asyncio.gather(*(ctl.ping_sandbox(sb.id) for _ in range(100)))
        assert len(answers) == 100 and all(a["busy"] is None for a in answers)
        used = client_ports(server.port) - before
        assert 1 <= len(used) <= 8  # pooled: at most max_connections, kept open after the calls
        answers = await asyncio.gather(*(ctl.ping_sandbox(sb.id) for _ in range(100)))
        assert len(answers) == 100
        assert client_ports(server.port) - before == used  # kept alive: the same connections again
    assert not client_ports(server.port) - before  # closed with the controller
    sb.kill()


def test_the_sync_controller_keeps_its_connection(server, snap):
    sb = snap.fork(1)[0]
    with Controller(server.url, server.token) as ctl:
        before = client_ports(server.port)
        ctl.ping_sandbox(sb.id)
        used = client_ports(server.port) - before
        for _ in range(20):
            ctl.ping_sandbox(sb.id)
            ctl.list_sandboxes()
        assert len(used) == 1 and client_ports(server.port) - before == used
    assert not client_ports(server.port) - before
    sb.kill()


def test_the_sync_sdk_interrupts_a_cell_its_caller_gave_up_on(snap):
    """The same core in the sync SDK: a loop left early, or a callback that raised, stops the cell."""
    sb = snap.fork(1)[0]
    for event in sb.run_stream("print('going', flush=True)\ntime.sleep(60)"):
        if event.get("type") == "stream":
            break
    assert sb.ping()["busy"] is None, signal_report(sb.info.get("pid"))

    def refuse(text: str) -> None:
        raise ValueError("seen enough")

    with pytest.raises(ValueError, match="seen enough"):
        sb.run_code("print('going', flush=True)\ntime.sleep(60)", on_stdout=refuse)
    assert sb.ping()["busy"] is None
    assert sb.eval("base") == "41"
    sb.kill()
