"""The router's state and decisions: the host table, the pins, placement and the merged views.
Handlers (handlers.py) parse and answer; everything that needs more than one host is here.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from .discovery import parse_dns, resolve
from .events import EventHub
from .hosts import Capacity, Heartbeat, Host, HostError
from .placement import Candidate, NoRoom, Part, pick_host, place
from .state import State

log = logging.getLogger("forkd.router")

KINDS = {"sandbox": "/v1/sandboxes", "workspace": "/v1/workspaces", "kernel": "/v1/kernels"}
ID_RETRIES = 3  # spawns again when a host handed out an id another host already uses


class Refusal(Exception):
    """An answer the router gives itself: ``status`` and ``{"error": message, **fields}``."""

    def __init__(self, status: int, message: str, **fields):
        super().__init__(message)
        self.status, self.message, self.fields = status, message, fields


@dataclass
class Settings:
    heartbeat: float = 2.0       # s between two heartbeats of a host
    down_after: float = 10.0     # s without a good heartbeat before a host is down
    host_timeout: float = 5.0    # s a host has to answer one of the router's own reads
    connect_timeout: float = 5.0  # s to connect to a host for a call passed on
    placement_wait: float = 1.0  # s a spawn waits for a host's snapshot listing before using its last one
    control_connections: int = 8
    call_connections: int = 100
    hosts_ca: str | None = None  # a CA file for https hosts (else the system's CAs)


class Router:
    """``urls``: the hosts (``--hosts``); or ``dns``: a URL whose name resolves to them (``--hosts-dns``,
    discovery.py), in which case the hosts recorded in the state file are kept too (one that is down
    keeps its sandboxes listed lost across a router restart)."""

    listed = None  # called with (host url, kind, items) for each listing a host gives (hub.py keeps their labels)

    def __init__(self, urls: list[str], token: str | None, state_path: str, settings: Settings | None = None,
                 rng: random.Random | None = None, dns: str | None = None):
        self.settings = settings or Settings()
        self.state = State(state_path)
        self.token = token
        self.dns = parse_dns(dns) if dns else None
        self.hosts: dict[str, Host] = {}
        self.events = EventHub(on_event=self._learn, on_connect=self._resubscribed)
        self.rng = rng or random.Random()
        self.heartbeat = Heartbeat(interval=self.settings.heartbeat, down_after=self.settings.down_after,
                                   timeout=self.settings.host_timeout, on_up=self._host_up, on_down=self._host_down)
        self._pulls: dict[tuple[str, str], asyncio.Future] = {}
        self._saved = self.state.hosts()
        self._tls = None
        self._started = False
        self.stopping = False  # the loops of its chores end on it (a cancel alone may be taken for a timeout)
        self._discovery: asyncio.Task | None = None
        self.chores: list[asyncio.Task] = []  # what runs beside the heartbeat (pending.py), until stop
        for url in (list(self._saved) if self.dns else []) + list(urls):
            self.add_host(url)

    def add_host(self, url: str, why: str | None = None) -> Host:
        """``why``: how it was found, for the log (default: ``--hosts-dns``'s name or ``--hosts``)."""
        url = url.rstrip("/")
        if url in self.hosts:
            return self.hosts[url]
        host = self.hosts[url] = Host(url, self.token)
        old = self._saved.get(url)
        if old and old["state"] == "down":  # still down until it answers: its sandboxes stay lost
            host.state, host.reason = "down", old["reason"]
        if self._started:
            s = self.settings
            host.open(s.control_connections, s.call_connections, self._tls)
            self.heartbeat.watch(host)
            log.warning("host %s joined (%s)", url, why or (f"{self.dns[1]} resolves to it" if self.dns else "--hosts"))
        return host

    async def discover(self) -> None:
        """Add every host ``--hosts-dns`` resolves to now that the table does not have yet."""
        if self.dns is not None:
            for url in await resolve(*self.dns):
                self.add_host(url)

    async def _discover_forever(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.settings.heartbeat)
            try:
                await self.discover()
            except Exception:  # noqa: BLE001 - a failed lookup is tried again at the next beat
                log.exception("resolving %s failed", self.dns[1])

    async def start(self) -> None:
        s = self.settings
        self._tls = ssl.create_default_context(cafile=s.hosts_ca) if s.hosts_ca else None
        await self.discover()
        for host in self.hosts.values():
            host.open(s.control_connections, s.call_connections, self._tls)
        await asyncio.gather(*(self.heartbeat.beat(h) for h in self.hosts.values()))
        self._started = True
        for host in list(self.hosts.values()):
            self.heartbeat.watch(host)
        if self.dns is not None:
            self._discovery = asyncio.ensure_future(self._discover_forever())

    async def stop(self) -> None:
        self.stopping = True
        if self._discovery is not None:
            self._discovery.cancel()
        for chore in self.chores:
            chore.cancel()
        await asyncio.gather(*self.chores, return_exceptions=True)
        await self.heartbeat.stop()
        if self._discovery is not None:
            await asyncio.gather(self._discovery, return_exceptions=True)
        self.events.close()
        for host in self.hosts.values():
            await host.close()
        self.state.close()

    def up_hosts(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.up]

    # --- host state changes ---------------------------------------------------------------------

    async def reconcile(self, host: Host) -> set[str] | None:
        """Make the pins of ``host`` what it lists now (sandboxes it ended go, ones made on it
        directly come); the ids of sandboxes that went, None if it did not answer its listings."""
        listed_at, asked_at = time.time(), host.changes
        try:
            listed = await asyncio.gather(*(host.get_json(path, self.settings.host_timeout)
                                            for path in ("/v1/sandboxes", "/v1/snapshots", "/v1/workspaces")))
        except HostError as exc:
            host.last_error = f"answered /healthz but not its listings: {exc.reason}"
            return None
        sandboxes, snapshots, workspaces = (x if isinstance(x, list) else [] for x in listed)
        host.set_listing(snapshots, asked_at)
        if self.listed is not None:  # under JupyterHub: whose each is (hub.py)
            for kind, items in (("sandbox", sandboxes), ("snapshot", snapshots), ("workspace", workspaces)):
                self.listed(host.url, kind, items)
        gone: set[str] = set()
        for kind, items, key in (("sandbox", sandboxes, "id"), ("snapshot", snapshots, "tag"),
                                 ("workspace", workspaces, "name")):
            records = {i[key]: i for i in items if isinstance(i, dict) and isinstance(i.get(key), str)}
            if kind == "sandbox":  # an id another host holds is that host's (first pinned wins)
                records = {k: v for k, v in records.items() if self.state.host_of("sandbox", k) in (None, host.url)}
            _, dropped = self.state.replace_host_pins(host.url, kind, records, listed_at)
            if kind == "sandbox":
                gone = dropped
        return gone

    async def _resubscribed(self, host: Host) -> None:
        """The host's event stream (re)opened: what changed while it was not followed is read from
        its listings, so no pin is left stale by a missed event."""
        for sid in await self.reconcile(host) or ():
            self.events.publish({"kind": "sandbox", "action": "deleted", "id": sid, "host": host.url,
                                 "reason": "ended while the router did not follow its host's events"})

    async def _host_up(self, host: Host) -> None:
        """Reconcile, then up, so no work lands on a host before its pins are right."""
        gone = await self.reconcile(host)
        if gone is None:
            return
        was = host.state
        if was == "down":
            for sid in gone:
                self.events.publish({"kind": "sandbox", "action": "deleted", "id": sid, "host": host.url,
                                     "reason": "ended while its host was down"})
        host.state, host.reason, host.last_error = "up", None, None
        self.state.save_host(host.url, "up", None, host.last_ok, host.capacity and host.capacity.to_json())
        self.events.follow(host, self.settings.heartbeat)
        if was == "down":
            log.warning("host %s is back: reconciled", host.url)
            self.events.publish({"kind": "host", "action": "up", "host": host.url})

    async def _host_down(self, host: Host, reason: str) -> None:
        host.state, host.reason = "down", reason
        self.events.unfollow(host)
        self.state.save_host(host.url, "down", reason, host.last_ok, None)
        log.warning("host %s is down: %s", host.url, reason)
        self.events.publish({"kind": "host", "action": "down", "host": host.url, "reason": reason})
        for sid in self.state.pinned_on(host.url, "sandbox"):
            self.events.publish({"kind": "sandbox", "action": "lost", "id": sid, "host": host.url,
                                 "status": "lost", "reason": f"its host is down: {reason}"})

    def _learn(self, host: Host, event: dict) -> None:
        """Keep the pins current from a host's events (objects made or ended on it directly)."""
        kind, action = event.get("kind"), event.get("action")
        if kind == "snapshot":
            host.changed()  # its kept listing is no longer what it holds
        key = event.get({"sandbox": "id", "snapshot": "tag", "workspace": "name"}.get(kind, ""), None)
        if not isinstance(key, str):
            return
        if action in ("killed", "deleted"):
            self.state.unpin(kind, key, host.url)
        elif action == "created" and kind in ("sandbox", "workspace") and self.state.host_of(kind, key) is None:
            self.state.pin(kind, [(key, {k: v for k, v in event.items() if k not in ("seq", "action")})], host.url)
        elif kind == "snapshot" and action in ("created", "status") and event.get("status") in ("ready", "writing") \
                and host.url not in self.state.hosts_of("snapshot", key):
            self.state.pin("snapshot", [(key, None)], host.url, exclusive=False)

    # --- where an object is -----------------------------------------------------------------------

    def lost(self, kind: str, key: str, host: Host) -> Refusal:
        what = {"sandbox": "sandbox", "workspace": "workspace", "kernel": "kernel"}.get(kind, kind)
        return Refusal(410, f"{what} {key} is lost: its host {host.url} is down ({host.reason})\n"
                            f"it answers again if the host comes back; new work goes to the hosts that are up",
                       lost={"host": host.url, "reason": host.reason})

    async def locate(self, kind: str, key: str) -> Host:
        """The host of a sandbox, workspace or kernel: its pin, else asked of every up host (an
        object made on a host directly); 404 if none has it, 410 if its host is down."""
        url = self.state.host_of(kind, key)
        if url is not None and url in self.hosts:
            host = self.hosts[url]
            if host.state == "down":
                raise self.lost(kind, key, host)
            return host
        found, answers = await self._ask_all(f"{KINDS[kind]}/{quote(key, safe='')}")
        if found:
            host, record = found[0]
            self.state.pin(kind, [(key, record)], host.url)
            return host
        ended = next((body for status, body in answers if status == 404 and isinstance(body, dict)
                      and body.get("ended")), None)
        if ended is not None:
            raise Refusal(404, ended.get("error", f"{kind} {key} not found"),
                          **{k: v for k, v in ended.items() if k != "error"})
        raise self.unknown(kind, key)

    def unknown(self, kind: str, key: str) -> Refusal:
        """The 404 for an id no host has (and, under JupyterHub, for one the caller may not see).
        Hosts that are not up were not asked: the message names them and why, since what they hold
        is the likely answer (a host the router cannot read, e.g. without --hosts-token-file, is never up)."""
        return Refusal(404, f"{kind} {key} not found on any host of the fleet" + self.not_up_note())

    def not_up_note(self) -> str:
        """'' when every host is up, else the hosts that are not, with why, and what to do."""
        out = [h for h in self.hosts.values() if not h.up]
        if not out:
            return ""
        why = "; ".join(f"{h.url}: {h.reason or h.last_error or 'not answered yet'}" for h in out)
        fix = (" (start the router with --hosts-token-file FILE, the token the hosts were started with)"
               if any("answered 401" in (h.reason or h.last_error or "") for h in out) else "")
        return (f" that is up\n{len(out)} of {len(self.hosts)} hosts are not up, so were not asked: {why}{fix}; "
                f"GET /v1/fleet/hosts shows each")

    async def _ask_all(self, path: str) -> tuple[list[tuple[Host, Any]], list[tuple[int, Any]]]:
        hosts = self.up_hosts()
        got = await asyncio.gather(*(h.request_json("GET", path, timeout=self.settings.host_timeout) for h in hosts),
                                   return_exceptions=True)
        found, answers = [], []
        for host, g in zip(hosts, got):
            if isinstance(g, BaseException):
                continue
            status, body = g
            answers.append((status, body))
            if status == 200:
                found.append((host, body))
        return found, answers

    async def holders(self, tag: str) -> tuple[dict[str, dict], list[Host]]:
        """Which up hosts hold snapshot ``tag`` (url -> its listing entry), and the up hosts whose
        listing is known. Each host's listing is read now; one that takes longer than
        ``placement_wait`` is not waited for: its last listing stands in (a slow host delays no
        placement by more than that), and without one it takes no part."""
        hosts = self.up_hosts()
        asked = {h.url: h.changes for h in hosts}
        reads = {asyncio.ensure_future(h.get_json("/v1/snapshots", self.settings.host_timeout)): h for h in hosts}
        if reads:
            _, late = await asyncio.wait(reads, timeout=self.settings.placement_wait)
            for task in late:
                task.cancel()
        held, answered = {}, []
        for task, host in reads.items():
            listing = task.result() if task.done() and not task.cancelled() and task.exception() is None else None
            if isinstance(listing, list):
                host.set_listing(listing, asked[host.url])
            elif host.listing is None:
                continue
            else:
                log.info("placement of %s: %s is slow, its last snapshot listing stands in", tag, host.url)
            answered.append(host)
            for snap in host.listing:
                if isinstance(snap, dict) and snap.get("tag") == tag:
                    held[host.url] = snap
        return held, answered

    # --- placement ----------------------------------------------------------------------------------

    def candidates(self, hosts: list[Host], held: dict[str, dict]) -> list[Candidate]:
        out = []
        for h in hosts:
            snap = held.get(h.url)
            cap = h.capacity
            out.append(Candidate(h.url, snap is not None and snap.get("status") == "ready",
                                 snap.get("engine") if snap else None,
                                 cap.memory_free if cap else None, cap.free_slots if cap else None))
        return out

    async def plan_spawn(self, tag: str, n: int, fresh: bool = False) -> tuple[list[Part], list[str], bool]:
        """The parts of a spawn, the up hosts holding ``tag`` (a pull's source if it must move), and
        whether the plan came from the kept listings (``kept_plan``); ``fresh``: read them all now."""
        if not fresh:
            kept = self.kept_plan(tag, n)
            if kept is not None:
                return (*kept, True)
        held, answered = await self.holders(tag)
        if not held:
            down = [u for u in self.state.hosts_of("snapshot", tag) if self.hosts.get(u) and not self.hosts[u].up]
            if down:
                raise Refusal(410, f"snapshot {tag} is lost: its host {down[0]} is down "
                                   f"({self.hosts[down[0]].reason})\nspawn from a snapshot another host holds",
                              lost={"host": down[0], "reason": self.hosts[down[0]].reason})
            raise self.unknown("snapshot", tag)
        if not any(s.get("status") == "ready" for s in held.values()):
            status = next(iter(held.values())).get("status")
            raise Refusal(409, f"snapshot `{tag}` is not bootable: status={status}")
        try:
            return place(tag, n, self.candidates(answered, held), self.rng), list(held), False
        except NoRoom:
            pass
        # The figures are the last heartbeat's: sandboxes may have ended since. Read them afresh
        # before a refusal stands (each host still refuses what it cannot take, with its own 503).
        await asyncio.gather(*(self.refresh_capacity(h) for h in answered))
        try:
            return place(tag, n, self.candidates(answered, held), self.rng), list(held), False
        except NoRoom as exc:
            raise Refusal(exc.status, exc.message, room=exc.room) from None

    def kept_plan(self, tag: str, n: int) -> tuple[list[Part], list[str]] | None:
        """A spawn's parts from the snapshot listings the router keeps, asking no host: only when
        every up host's listing is current (``Host.kept_listing``) and hosts holding ``tag`` ready
        take all ``n``, else None, and placement reads the listings afresh (as it does for anything
        it would refuse, or move by a pull). A listing can still trail its host by an event in
        flight: a part its host then refuses (404, 409) is placed again on fresh listings."""
        hosts = self.up_hosts()
        listings = [h.kept_listing() for h in hosts]
        if not hosts or any(listing is None for listing in listings):
            return None
        held = {h.url: snap for h, listing in zip(hosts, listings) for snap in listing
                if isinstance(snap, dict) and snap.get("tag") == tag}
        if not any(snap.get("status") == "ready" for snap in held.values()):
            return None
        try:
            parts = place(tag, n, self.candidates(hosts, held), self.rng)
        except NoRoom:
            return None
        return None if any(p.pull for p in parts) else (parts, list(held))

    async def refresh_capacity(self, host: Host) -> None:
        """The host's capacity block as it is now (its last one stands if it does not answer)."""
        try:
            host.capacity = Capacity.parse(await host.get_json("/healthz", self.settings.host_timeout)) or host.capacity
        except HostError:
            pass

    def place_new(self, exclude: set[str] = frozenset()) -> Host:
        """The host for a new snapshot (create, pull): best-of-K by free memory among the up hosts."""
        hosts = [h for h in self.up_hosts() if h.url not in exclude]
        best = pick_host(self.candidates(hosts, {}), self.rng)
        if best is None:
            raise Refusal(503, "no host of the fleet is up\nsee GET /v1/fleet/hosts for why each is down")
        return self.hosts[best.host]

    async def ensure_pulled(self, host: Host, tag: str, holders: list[str]) -> None:
        """Bring VM snapshot ``tag`` to ``host`` from the store; if it was never pushed, a holder
        pushes it first. Concurrent spawns on one host pull once."""
        key = (host.url, tag)
        pending = self._pulls.get(key)
        if pending is None:
            pending = self._pulls[key] = asyncio.ensure_future(self._pull(host, tag, holders))
            pending.add_done_callback(lambda _f: self._pulls.pop(key, None))
        await asyncio.shield(pending)

    async def _pull(self, host: Host, tag: str, holders: list[str]) -> None:
        status, body = await host.request_json("POST", "/v1/snapshots/pull", {"tag": tag}, timeout=None,
                                               session="calls")
        if status == 404 and holders:  # not in the store yet: its host pushes it, then pull again
            source = self.hosts[holders[0]]
            pstatus, pbody = await source.request_json("POST", f"/v1/snapshots/{tag}/push", timeout=None,
                                                       session="calls")
            if pstatus != 200:
                raise Refusal(pstatus, f"snapshot {tag} could not move to {host.url}: its host {source.url} did "
                                       f"not push it to the store: {_error(pbody)}")
            status, body = await host.request_json("POST", "/v1/snapshots/pull", {"tag": tag}, timeout=None,
                                                   session="calls")
        if status == 409 and "taken" in _error(body):
            return  # pulled meanwhile (another router, or a spawn that raced this one)
        if status != 201:
            raise Refusal(status if status >= 400 else 502,
                          f"snapshot {tag} could not move to {host.url}: its pull from the store answered "
                          f"{status}: {_error(body)}")
        self.state.pin("snapshot", [(tag, None)], host.url, exclusive=False)

    async def spawn_part(self, part: Part, body: dict, headers: dict) -> tuple[int, Any]:
        """One host's share of a spawn, with ids checked against the pins: a host may hand out an
        id another host uses (ids are numbered per host), and such children are killed and spawned
        again there (a new number each time)."""
        host = self.hosts[part.host]
        kids: list[dict] = []
        want = part.n
        for _ in range(ID_RETRIES + 1):
            status, got = await host.request_json("POST", "/v1/sandboxes", {**body, "n": want}, timeout=None,
                                                  session="calls", headers=headers)
            if status != 201 or not isinstance(got, list):
                await self.kill(host, [k["id"] for k in kids])
                return status, got
            if host.capacity is not None:  # until the next heartbeat says how many it holds
                host.capacity = host.capacity.counted(len(got))
            again = [k for k in got if any(k["id"] == mine["id"] for mine in kids)]
            taken = set(self.state.claim("sandbox", [(k["id"], k) for k in got if k not in again], host.url))
            clash = again + [k for k in got if k["id"] in taken]
            good = [k for k in got if k not in clash]
            kids += good
            if not clash:
                return 201, [{**k, "host": host.url} for k in kids]
            log.warning("host %s handed out ids in use elsewhere (%s): spawning those again",
                        host.url, ", ".join(k["id"] for k in clash))
            await self.kill(host, [k["id"] for k in clash], unpin=False)
            want = len(clash)
        await self.kill(host, [k["id"] for k in kids])
        return 409, {"error": f"host {host.url} kept handing out sandbox ids other hosts use; give its data dir "
                              f"a fresh registry"}

    async def kill(self, host: Host, ids: list[str], unpin: bool = True, reason: str | None = None) -> None:
        """Kill ``ids`` on ``host``; ``reason``: why, as each one's 404 says it afterwards."""
        why = f"?reason={quote(reason, safe='')}" if reason else ""

        async def one(sid: str) -> None:
            try:
                await host.request_json("DELETE", f"/v1/sandboxes/{sid}{why}", timeout=60, session="calls")
            except HostError:
                pass
            if unpin:
                self.state.unpin("sandbox", sid, host.url)
        await asyncio.gather(*(one(s) for s in ids))
        if host.capacity is not None and ids:
            host.capacity = host.capacity.counted(-len(ids))

    # --- merged views ---------------------------------------------------------------------------

    async def gather_lists(self, path: str) -> tuple[list[tuple[Host, list]], list[str]]:
        """GET ``path`` on every up host; (host, list) for those that answered a list, and why the
        others are missing."""
        hosts = self.up_hosts()
        got = await asyncio.gather(*(h.get_json(path, self.settings.host_timeout) for h in hosts),
                                   return_exceptions=True)
        out, missing = [], []
        for host, g in zip(hosts, got):
            if isinstance(g, list):
                out.append((host, g))
            else:
                missing.append(f"{host.url}: {g.reason if isinstance(g, HostError) else 'answered what is not a list'}")
        return out, missing

    def lost_records(self, kind: str) -> list[dict]:
        """The last known record of every ``kind`` pinned to a host that is down, marked lost."""
        out = []
        for host in self.hosts.values():
            if host.state != "down":
                continue
            for key, record in self.state.pinned_on(host.url, kind).items():
                rec = dict(record or {})
                rec.update({"id" if kind == "sandbox" else "tag": key, "status": "lost", "host": host.url,
                            "lost": {"host": host.url, "reason": host.reason}})
                out.append(rec)
        return out

    def hosts_json(self) -> list[dict]:
        return [h.to_json() for h in self.hosts.values()]


def _error(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return repr(body)[:200]
