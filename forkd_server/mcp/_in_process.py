"""The quick calls of the MCP tools, made on the server's own controller when the MCP server lives in
it (``{base_url}forkd/mcp`` in jupyter-server, ``/mcp`` in ``forkd serve``).

Every other tool goes through the SDK, back into the same server over HTTP. For ``eval_code``,
``exec_command`` and ``ping_sandbox`` (an agent's most frequent calls, each a few ms of work in the
sandbox) that second request was a third of the server's CPU per call: a request parsed,
authenticated and answered on the same loop, with a thread carrying the SDK's blocking call on each
side. Here the call is the one its
REST route makes, admitted the same way (the MCP server is one caller, user code runs one call at a
time per sandbox), and its answer and errors are the route's: the result as the route's JSON, a
failure as the ``ControllerError`` (status and body) the SDK would have raised."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from ..client import ControllerError
from ..errors import internal_error
from ..handlers.base import ApiError, dumps, settled

log = logging.getLogger("forkd.mcp")
CALLER = "forkd-mcp"  # whose long calls these are, for the per-caller cap


class InProcess:
    """``eval_code``, ``exec_command`` and ``ping_sandbox`` of ``app`` (the forkd extension), awaited
    on its loop; ``url``: the server's forkd routes, which errors name as the SDK's do."""

    def __init__(self, app, url: str):
        self.app, self.url = app, url.rstrip("/")

    async def eval_code(self, sandbox_id: str, code: str) -> dict[str, Any]:
        call = self.app.loop_calls.eval(self.app.controller, sandbox_id, code, caller=CALLER)
        return await self._answer(call, sandbox_id, "eval")

    async def exec_command(self, sandbox_id: str, args: list[str], timeout_secs: float) -> dict[str, Any]:
        call = self.app.loop_calls.exec(self.app.controller, sandbox_id, list(args), timeout_secs, caller=CALLER)
        return await self._answer(call, sandbox_id, "exec")

    async def ping_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return await self._answer(self.app.loop_calls.ping(self.app.controller, sandbox_id), sandbox_id, "ping")

    async def _answer(self, call, sandbox_id: str, route: str) -> dict[str, Any]:
        try:
            result = await settled(self.app, call, sandbox_id)
        except ApiError as exc:
            raise ControllerError(exc.status_code, {"error": exc.message, **exc.fields}, self._url(sandbox_id, route)) \
                from None
        except Exception as exc:  # noqa: BLE001 - what the route answers as a 500
            log.exception("forkd mcp: %s of %s failed", route, sandbox_id)
            raise ControllerError(500, {"error": internal_error(exc)}, self._url(sandbox_id, route)) from None
        return orjson.loads(dumps(result))  # the route's JSON: what a client of it reads, nothing more

    def _url(self, sandbox_id: str, route: str) -> str:
        return f"{self.url}/v1/sandboxes/{sandbox_id}/{route}"
