"""A host that registers itself with a fleet's router: ``forkd serve --register ROUTER_URL
--register-token-file F [--advertise-url URL]``.

The server announces its URL (``POST ROUTER_URL/v1/fleet/register {"url"}``, with the registration
token) once it listens, then again as often as the router's answer says (its heartbeat), so the
router adds it to its table and keeps it up; a host that stops announcing (stopped, or cut off) is
down at the router after its ``--down-after``. A failed announcement is tried again at the same pace;
the log says so once per change (registered, or why not), not at every try.
"""

from __future__ import annotations

import asyncio
import json
import logging

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

DEFAULT_EVERY = 2.0  # s between announcements until the router says its own pace
PACE = (0.2, 60.0)   # the router's pace is taken within these bounds
TIMEOUT = 10.0       # s an announcement may take


class Announcer:
    def __init__(self, router_url: str, token: str, own_url: str, log: logging.Logger | None = None):
        self.endpoint = router_url.rstrip("/") + "/v1/fleet/register"
        self.token, self.own_url = token, own_url
        self.log = log or logging.getLogger("forkd")
        self.every = DEFAULT_EVERY
        self.said: str | None = None  # the last state logged
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def announce(self) -> bool:
        """One announcement; True if the router took it."""
        request = HTTPRequest(self.endpoint, method="POST", body=json.dumps({"url": self.own_url}),
                              headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
                              request_timeout=TIMEOUT, connect_timeout=TIMEOUT)
        try:
            reply = await AsyncHTTPClient().fetch(request, raise_error=False)
        except (OSError, asyncio.TimeoutError) as exc:
            return self._say(f"could not register with the router at {self.endpoint}: {exc}", ok=False)
        try:
            body = json.loads(reply.body or b"null")
        except ValueError:
            body = None
        if reply.code != 200 or not isinstance(body, dict):
            why = body.get("error") if isinstance(body, dict) else (reply.error or f"answer {reply.code}")
            fix = {401: "; --register-token-file must hold the token the router was started with (forkd router "
                        "--register-token-file)",
                   404: "; is --register the router's URL, and was it started with --register-token-file?"}.get(
                reply.code, "")
            return self._say(f"the router at {self.endpoint} refused the registration ({reply.code}): {why}{fix}",
                             ok=False)
        every = body.get("announce_every")
        if isinstance(every, (int, float)) and not isinstance(every, bool):
            self.every = min(max(float(every), PACE[0]), PACE[1])
        return self._say(f"registered with the router at {self.endpoint} as {self.own_url} (announcing every "
                         f"{self.every:g} s; the router counts this host down {body.get('down_after')} s after the "
                         f"last)", ok=True)

    def _say(self, message: str, ok: bool) -> bool:
        if message != self.said:
            (self.log.info if ok else self.log.warning)("forkd: %s", message)
            self.said = message
        return ok

    async def _run(self) -> None:
        while True:
            try:
                await self.announce()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug in one announcement must not end them
                self.log.exception("forkd: announcing this host to the router failed")
            await asyncio.sleep(self.every)
