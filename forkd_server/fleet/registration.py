"""Hosts that register themselves: ``forkd serve --register ROUTER_URL --register-token-file F``.

A host announces its URL with ``POST /v1/fleet/register {"url"}`` and the registration token (the
router's ``--register-token-file``, compared in constant time), and again every ``announce_every``
seconds (the router's heartbeat, said in the answer). The first announcement adds the host to the
table (beaten at once, so it is up as soon as it answers); each one is recorded in the state file,
so the host stays in the table across a router restart and a second router on the same file
learns it too. A host that stops announcing is ``down`` once ``--down-after`` seconds pass since its
last announcement (hosts.py), even if its ``/healthz`` still answers, and up again when it
announces itself again. A host is never dropped from the table: down, its sandboxes are ``lost``.

The registration token lets whoever holds it make the router call a URL of their choosing with the
hosts' token: give it to the hosts only, as the hosts' token itself.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .discovery import url_problem
from .router import Refusal, Router

log = logging.getLogger("forkd.router")


class Registrations:
    """``token``: the registration token; ``static``: the hosts given by ``--hosts``, which are up by
    their heartbeat alone (an announcement of one changes nothing)."""

    def __init__(self, router: Router, token: str, static: list[str] = ()):
        self.router, self.token, self.static = router, token, set(static)
        self._task: asyncio.Task | None = None

    def restore(self) -> None:
        """Add the hosts the state file says registered (before the router starts). The router heard
        no announcement while it was not running: each has ``--down-after`` from now to announce."""
        now = time.time()
        for url in self.router.state.registered():
            if url not in self.static:
                self.router.add_host(url).announced_at = now

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._follow_state())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def announce(self, body) -> dict:
        """One announcement; the answer tells the host how often to announce."""
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url.strip():
            raise Refusal(400, 'a registration is {"url": "http(s)://HOST:PORT"}: the address this router reaches '
                               'the host at')
        url = url.strip().rstrip("/")
        if why := url_problem(url):
            raise Refusal(400, f"url {url[:200]!r} is not a host's URL: {why}")
        router, now = self.router, time.time()
        router.state.save_registration(url, now)
        host = router.add_host(url, "it registered itself")
        if url not in self.static:
            host.announced_at = now
        if host.state != "up":  # up at once when it answers, not at its next heartbeat
            await router.heartbeat.beat(host)
        s = router.settings
        return {"ok": True, "url": url, "state": host.state, "reason": host.reason,
                "announce_every": s.heartbeat, "down_after": s.down_after}

    async def _follow_state(self) -> None:
        """Announcements another router on the same state file heard count here too."""
        while True:
            await asyncio.sleep(self.router.settings.heartbeat)
            try:
                for url, at in self.router.state.registered().items():
                    if url in self.static:
                        continue
                    host = self.router.add_host(url, "it registered itself with another router on this state file")
                    if host.announced_at is None or at > host.announced_at:
                        host.announced_at = at
            except Exception:  # noqa: BLE001 - read again at the next beat
                log.exception("reading the registered hosts failed")
