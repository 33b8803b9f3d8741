"""The host table: each host's state, capacity and connections, kept current by a heartbeat.

A host is a ``forkd serve`` the router was given (``--hosts``). Every ``heartbeat`` seconds the
router reads its ``GET /healthz``: a good answer (``{"ok": true, ...}`` within ``host_timeout``)
keeps it ``up`` and refreshes its capacity; a host with no good answer for ``down_after`` seconds is
``down``, with the reason; so is a host that registers itself (``registration.py``) and has not
announced itself for ``down_after`` seconds. A host that was not up (at start, or back after being down) is
reconciled before it is ``up`` again (``Router.reconcile``), so no work is placed on it meanwhile.

Each host has two bounded pools of kept-alive connections (aiohttp): ``control`` for the router's
own short reads (heartbeat, listings, lookups), each bounded by ``host_timeout``, and ``calls`` for
the calls it passes on. A host that is slow or full ties up its own pools only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

log = logging.getLogger("forkd.router")

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host", "content-length", "authorization", "cookie"})


@dataclass(frozen=True)
class Capacity:
    """A host's ``capacity`` block in ``/healthz``; a field the host did not state (or stated
    wrongly) is None, i.e. unknown."""

    memory_free: int | None = None
    sandboxes: int | None = None
    max_sandboxes: int | None = None
    snapshots: int | None = None
    load: float | None = None

    @classmethod
    def parse(cls, health: Any) -> Capacity | None:
        """The block of a ``/healthz`` answer, read defensively: None without one."""
        block = health.get("capacity") if isinstance(health, dict) else None
        if not isinstance(block, dict):
            return None

        def count(name: str) -> int | None:
            v = block.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

        load = block.get("load")
        load = float(load) if isinstance(load, (int, float)) and not isinstance(load, bool) and load >= 0 else None
        return cls(count("memory_free"), count("sandboxes"), count("max_sandboxes"), count("snapshots"), load)

    @property
    def free_slots(self) -> int | None:
        """Sandboxes the host takes before its cap; None when it states no cap (or no count)."""
        if self.max_sandboxes is None or self.sandboxes is None:
            return None
        return max(0, self.max_sandboxes - self.sandboxes)

    def counted(self, more: int) -> Capacity:
        """The same with ``more`` sandboxes (what the router placed since the host's last figure)."""
        if self.sandboxes is None:
            return self
        return Capacity(self.memory_free, max(0, self.sandboxes + more), self.max_sandboxes, self.snapshots, self.load)

    def to_json(self) -> dict:
        return {"memory_free": self.memory_free, "sandboxes": self.sandboxes, "max_sandboxes": self.max_sandboxes,
                "snapshots": self.snapshots, "load": self.load}


class HostError(Exception):
    """A host did not answer, or answered what is not forkd's API; the message says which and how."""

    def __init__(self, host: str, message: str):
        super().__init__(f"host {host}: {message}")
        self.host = host
        self.reason = message


@dataclass
class Host:
    url: str
    token: str | None
    state: str = "unknown"  # unknown | up | down
    reason: str | None = None  # why it is down
    last_ok: float | None = None
    last_error: str | None = None
    capacity: Capacity | None = None
    listing: list | None = None  # its last snapshot listing (placement's stand-in when it is slow)
    # Whether ``listing`` is still what the host holds: read while its event stream was open, and
    # no snapshot event (nor a closing or opening of the stream) since: ``changes`` counts those,
    # ``listing_changes`` is what it was when the listing was asked for.
    events_open: bool = False
    changes: int = 0
    listing_changes: int | None = None
    since: float = field(default_factory=time.time)  # when the router started watching it
    announced_at: float | None = None  # a host that registers itself: its last announcement (registration.py)
    control: aiohttp.ClientSession | None = None
    calls: aiohttp.ClientSession | None = None
    tls: ssl.SSLContext | None = None

    @property
    def up(self) -> bool:
        return self.state == "up"

    def open(self, control_connections: int, call_connections: int, tls: ssl.SSLContext | None = None) -> None:
        """Open its pools; ``tls``: how to check an https host's certificate (default: the system's CAs)."""
        self.tls = tls
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        for name, limit in (("control", control_connections), ("calls", call_connections)):
            connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=60, ssl=tls if tls is not None else True)
            setattr(self, name, aiohttp.ClientSession(connector=connector, headers=headers, auto_decompress=False,
                                                      skip_auto_headers=("Accept", "Content-Type")))

    async def close(self) -> None:
        for session in (self.control, self.calls):
            if session is not None:
                await session.close()

    def changed(self) -> None:
        """Its snapshots may have changed (an event said so, or its stream opened or closed)."""
        self.changes += 1

    def set_listing(self, listing: list, asked_at: int) -> None:
        """Its snapshot listing, asked for when ``changes`` was ``asked_at``."""
        self.listing, self.listing_changes = listing, asked_at

    def kept_listing(self) -> list | None:
        """Its last snapshot listing if nothing can have changed since it was read, else None."""
        return self.listing if self.events_open and self.listing_changes == self.changes else None

    def full(self) -> None:
        """The host refused a spawn over its cap: count it full until its next heartbeat."""
        cap = self.capacity
        if cap is not None and cap.max_sandboxes is not None:
            self.capacity = Capacity(cap.memory_free, cap.max_sandboxes, cap.max_sandboxes, cap.snapshots, cap.load)

    def to_json(self) -> dict:
        return {"url": self.url, "state": self.state, "reason": self.reason, "last_ok": self.last_ok,
                "last_error": self.last_error, "capacity": self.capacity.to_json() if self.capacity else None,
                "registered": self.announced_at is not None, "announced_at": self.announced_at}

    async def get_json(self, path: str, timeout: float) -> Any:
        """A control read: the JSON of a 200 answer within ``timeout`` seconds, else HostError."""
        status, body = await self.request_json("GET", path, timeout=timeout)
        if status != 200:
            raise HostError(self.url, f"GET {path} answered {status}: {_snippet(body)}")
        return body

    async def request_json(self, method: str, path: str, body: Any = None, *, timeout: float | None,
                           session: str = "control", headers: dict | None = None) -> tuple[int, Any]:
        """(status, parsed JSON or None for an empty body); HostError if the host does not answer
        in time or answers what is not JSON."""
        http = self.control if session == "control" else self.calls
        limits = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout or 5.0, 5.0))
        kwargs = {"headers": dict(headers or {})}
        if body is not None:
            kwargs["data"] = body if isinstance(body, bytes) else json.dumps(body).encode()
            kwargs["headers"]["Content-Type"] = "application/json"
        said = path.split("?")[0]  # a caller's query (a browser's cache-buster too) is no part of what failed
        try:
            async with http.request(method, self.url + path, timeout=limits, **kwargs) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            raise HostError(self.url, f"no answer to {method} {said} within {timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise HostError(self.url, f"{method} {said} failed: {exc or type(exc).__name__}") from None
        if not raw:
            return status, None
        try:
            return status, json.loads(raw)
        except ValueError:
            raise HostError(self.url, f"{method} {said} answered {status} with what is not JSON: "
                                      f"{raw[:80]!r}") from None


def _snippet(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"].splitlines()[0][:200]
    return repr(body)[:200]


class Heartbeat:
    """One task per host: ``/healthz`` every ``interval`` s; ``on_up(host)`` (which reconciles and
    decides) when a host that is not up answers, ``on_down(host, reason)`` once it has not for
    ``down_after`` s."""

    def __init__(self, *, interval: float, down_after: float, timeout: float, on_up, on_down):
        # a beat never waits longer than --down-after, so a host whose link hangs is down on time
        self.interval, self.down_after = interval, down_after
        self.timeout = min(timeout, down_after)
        self.on_up, self.on_down = on_up, on_down
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.beats = 0

    def watch(self, host: Host) -> None:
        """Beat ``host`` from now on (once per host; one discovered later is added so too)."""
        self._tasks.append(asyncio.ensure_future(self._watch(host)))

    async def stop(self) -> None:
        # The flag as well as the cancel: a cancel that lands as a beat's own timeout fires is
        # taken by aiohttp for that timeout (a HostError the beat handles), and a loop that only
        # cancels would beat on, holding the router's stop (and its exit) forever.
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def beat(self, host: Host) -> None:
        """One heartbeat of ``host`` (also called directly at start)."""
        try:
            health = await host.get_json("/healthz", self.timeout)
            if not (isinstance(health, dict) and health.get("ok") is True):
                raise HostError(host.url, f"/healthz answered {_snippet(health)} (not forkd's {{\"ok\": true}})")
        except HostError as exc:
            host.last_error = exc.reason
            silent = time.time() - (host.last_ok or host.since)
            if host.state != "down" and silent >= self.down_after:
                await self.on_down(host, f"no good answer to /healthz for {silent:.1f} s (the router's "
                                         f"--down-after is {self.down_after:g} s); last: {exc.reason}")
            return
        host.capacity = Capacity.parse(health)
        host.last_ok = time.time()
        if host.up:  # a host not up keeps why until it is (its listings may still be refused): no window of "no answer"
            host.last_error = None
        quiet = time.time() - host.announced_at if host.announced_at is not None else 0.0
        if quiet > self.down_after:  # a host that registers itself is up while it keeps announcing itself
            if host.state != "down":
                await self.on_down(host, f"it has not announced itself for {quiet:.1f} s (the router's --down-after "
                                         f"is {self.down_after:g} s), though its /healthz answers")
            return
        if host.state != "up":
            await self.on_up(host)

    async def _watch(self, host: Host) -> None:
        while not self._stopping:
            try:
                await self.beat(host)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug in one beat must not end the heartbeat
                log.exception("heartbeat of %s failed", host.url)
            self.beats += 1
            if not self._stopping:
                await asyncio.sleep(self.interval)
