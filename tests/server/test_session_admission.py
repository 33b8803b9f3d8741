"""Opening a streaming session (the WebSocket) is a long call like any other: it starts IPython in
the sandbox when it has none, so it holds a long-call slot, never a control thread or the event
loop's default pool, and past the server's cap it is refused 503 before the upgrade."""

from __future__ import annotations

import asyncio
import json

import pytest
from tornado.httpclient import HTTPClientError

from .test_admission import until
from .test_api import call, snap  # noqa: F401 - fixtures


@pytest.fixture
def jp_server_config(jp_server_config):
    return {**jp_server_config, "ForkdApp": {**jp_server_config["ForkdApp"], "max_long_calls": 1}}


async def until_busy(jp_fetch, sandbox: str, timeout: float = 30) -> None:
    """Until ``sandbox``'s main thread runs the cell: the server holding the call's slot says only
    that the request left for the agent, not that the agent has started it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (await call(jp_fetch, "POST", "sandboxes", sandbox, "ping"))[1]["busy"] is None:
        assert asyncio.get_running_loop().time() < deadline, f"sandbox {sandbox} did not start the cell in {timeout} s"
        await asyncio.sleep(0.01)


async def test_a_session_open_is_admitted_as_a_long_call(jp_fetch, jp_ws_fetch, forkd_app, snap):  # noqa: F811
    a, b = (s["id"] for s in forkd_app.controller.spawn("py", 2))
    cell = asyncio.ensure_future(call(jp_fetch, "POST", "sandboxes", a, "run",
                                      body={"code": "import time\ntime.sleep(60)", "timeout": 120}))
    await until(lambda: forkd_app.admission.running == 1, "the cell holds the only long-call slot")
    await until_busy(jp_fetch, a)  # an interrupt sent before the cell starts finds nothing to stop
    with pytest.raises(HTTPClientError) as refused:
        await jp_ws_fetch("forkd", "v1", "sandboxes", b, "session")
    assert refused.value.code == 503
    assert "max_long_calls" in json.loads(refused.value.response.body)["error"]
    code, interrupted = await call(jp_fetch, "POST", "sandboxes", a, "interrupt")
    assert code == 200 and interrupted["interrupted"] is True
    code, ran = await cell
    assert code == 200 and ran["error"]["ename"] == "KeyboardInterrupt"
    ws = await jp_ws_fetch("forkd", "v1", "sandboxes", b, "session")  # a free slot: it opens
    hello = json.loads(await ws.read_message())
    assert hello["type"] == "session_reply" and hello["content"]["status"] == "ok"
    ws.close()
    await until(lambda: forkd_app.admission.admitted == 0, "the open gave its slot back")
