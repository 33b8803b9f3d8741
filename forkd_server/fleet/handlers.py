"""The router's ``/v1``: the same routes as ``forkd serve``, each answered by the host that holds
its object (pinned calls, passed on as they stream), by placement (spawn, create, pull) or by all
hosts at once (lists, the tree, events), with a ``host`` on everything listed.

Wire rules are forkd serve's: ``{"error": ...}`` bodies, 401 ``missing bearer token`` /
``invalid bearer token`` before anything else, ``/healthz`` without a token. A host's answer is
passed on unchanged (status, body), so its errors reach the client word for word.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from urllib.parse import parse_qsl, urlencode

import aiohttp
from tornado import web
from tornado.iostream import StreamClosedError

from .. import __version__
from ..checks import MAX_CHILDREN
from ..identity import same_secret
from .hosts import HOP_BY_HOP, Host, HostError
from .router import Refusal, Router

OPENAPI_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "openapi.json")
MISSING_HEADER = "X-Forkd-Hosts-Missing"  # hosts whose part of a merged answer is missing, and why


def host_query(handler: web.RequestHandler) -> str:
    """The request's query without ``token`` (the router's secret, not the host's)."""
    pairs = [(k, v) for k, v in parse_qsl(handler.request.query, keep_blank_values=True) if k != "token"]
    return ("?" + urlencode(pairs)) if pairs else ""


def sent_token(handler: web.RequestHandler) -> str | None:
    header = handler.request.headers.get("Authorization", "").strip()
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() in ("bearer", "token"):
            return value.strip()
    return handler.get_query_argument("token", None)


def check_token(handler: web.RequestHandler, expected: str | None) -> None:
    if expected is None:
        return
    token = sent_token(handler)
    if not same_secret(token, expected):
        raise Refusal(401, "invalid bearer token" if token else "missing bearer token")


class RouterHandler(web.RequestHandler):
    public = False

    @property
    def router(self) -> Router:
        return self.settings["forkd_router"]

    def prepare(self) -> None:
        if not self.public:
            check_token(self, self.settings["forkd_token"])

    def check_xsrf_cookie(self) -> None:
        pass  # bearer tokens only: no cookie carries authority here

    def compute_etag(self):
        return None

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        fields = {}
        if isinstance(exc, Refusal):
            message, fields = exc.message, exc.fields
        elif isinstance(exc, web.HTTPError):
            message = (exc.log_message % exc.args) if exc.log_message else (exc.reason or self._reason)
        else:
            message = "internal error" if exc is None else f"internal error: {type(exc).__name__}: {exc}"
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": message, **fields}))

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, Refusal):
            if not self._finished:
                self.set_status(e.status)
                self.write_error(e.status, exc_info=(type(e), e, None))
            return
        super()._handle_request_exception(e)

    def send(self, body, status: int = 200, missing: list[str] | None = None) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        if missing:
            self.set_header(MISSING_HEADER, "; ".join(m.replace("\n", " ")[:300] for m in missing))
        self.finish(json.dumps(body))

    def answer(self, status: int, body) -> None:
        """Pass a host's answer on (a parsed one)."""
        if status == 204 or body is None:
            self.set_status(status)
            self.finish()
        else:
            self.send(body, status)

    def json_body(self) -> dict | None:
        """The body as a JSON object, or None when it is not one (a host then says what is wrong)."""
        ctype = self.request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
            return None
        try:
            data = json.loads(self.request.body or b"null")
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def client_headers(self) -> dict:
        """The request's headers a host should see: all but hop-by-hop ones and the credentials."""
        return {k: v for k, v in self.request.headers.get_all() if k.lower() not in HOP_BY_HOP}

    async def call(self, host: Host, path: str | None = None, body: bytes | None = None) -> tuple[int, object]:
        """This request passed on to ``host`` and its answer parsed (for small JSON answers the
        router adds to); HostError becomes 502."""
        try:
            return await host.request_json(self.request.method, path or (self.request.path + host_query(self)),
                                           body if body is not None else (self.request.body or None),
                                           timeout=None, session="calls", headers=self.client_headers())
        except HostError as exc:
            raise Refusal(502, f"{exc}\nthe router marks a host down after {self.router.settings.down_after:g} s "
                               f"without a good heartbeat", host=host.url) from None

    # --- passing a request on as it streams --------------------------------------------------------

    _upstream: asyncio.Task | None = None

    async def forward(self, host: Host, path: str | None = None) -> None:
        """Pass this request to ``host`` and its answer back as it arrives (no buffering); a
        client that goes away ends the host's request too."""
        self._upstream = asyncio.ensure_future(self._forward(host, path or self.request.path))
        try:
            await self._upstream
        except asyncio.CancelledError:
            if not self.request.connection.stream.closed():
                raise

    def on_connection_close(self) -> None:
        if self._upstream is not None:
            self._upstream.cancel()

    async def _forward(self, host: Host, path: str) -> None:
        s = self.router.settings
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout)
        try:
            async with host.calls.request(self.request.method, host.url + path + host_query(self),
                                          data=self.request.body or None, headers=self.client_headers(),
                                          timeout=timeout, allow_redirects=False) as resp:
                self.set_status(resp.status, resp.reason)
                for name, value in resp.headers.items():
                    if name.lower() not in HOP_BY_HOP and name.lower() not in ("server", "date"):
                        self.set_header(name, value)
                if resp.status in (204, 304):  # no body, whatever a host sends
                    self.finish()
                    return
                length = resp.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) <= 1 << 20:  # small: one write
                    self.finish(await resp.read())
                    return
                async for chunk in resp.content.iter_any():
                    self.write(chunk)
                    await self.flush()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if self._headers_written:
                self.request.connection.stream.close()  # cut mid-answer: the client sees it cut
                return
            self.clear_header("Content-Type")
            raise Refusal(502, f"host {host.url} did not answer: {exc or type(exc).__name__}\nthe router marks a "
                               f"host down after {s.down_after:g} s without a good heartbeat", host=host.url) from None
        except StreamClosedError:
            return
        self.finish()


# --- meta ---------------------------------------------------------------------------------------

class HealthHandler(RouterHandler):
    public = True

    def get(self) -> None:
        hosts = self.router.hosts.values()
        self.send({"ok": True, "router": True, "hosts": len(hosts), "hosts_up": sum(h.up for h in hosts)})


class VersionHandler(RouterHandler):
    def get(self) -> None:
        self.send({"version": __version__, "api": "v1", "router": True})


class HostsHandler(RouterHandler):
    """``GET /v1/fleet/hosts``: the host table (state, why a host is down, its capacity)."""

    def get(self) -> None:
        self.send(self.router.hosts_json())


class MetricsHandler(RouterHandler):
    def get(self) -> None:
        hosts = list(self.router.hosts.values())
        lines = ["# HELP forkd_fleet_hosts Hosts of the fleet by state.", "# TYPE forkd_fleet_hosts gauge"]
        for state in ("up", "down", "unknown"):
            lines.append(f'forkd_fleet_hosts{{state="{state}"}} {sum(h.state == state for h in hosts)}')
        lines += ["# HELP forkd_fleet_host_up Whether a host is up (1) or not (0).", "# TYPE forkd_fleet_host_up gauge"]
        lines += [f'forkd_fleet_host_up{{host="{h.url}"}} {int(h.up)}' for h in hosts]
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish("\n".join(lines) + "\n")


class OpenAPIHandler(RouterHandler):
    def get(self) -> None:
        with open(OPENAPI_PATH) as f:
            doc = json.load(f)
        doc["servers"] = [{"url": "/"}]
        self.send(doc)


class EventsHandler(RouterHandler):
    """Every host's events in one stream, each with its ``host``, and the router's own."""

    _queue = None

    async def get(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        hub = self.router.events
        self._queue = queue = hub.subscribe()
        keepalive = self.settings.get("sse_keepalive", 15.0)
        try:
            self.write(": forkd fleet events\n\n")
            await self.flush()
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), keepalive)
                except asyncio.TimeoutError:
                    self.write(": keep-alive\n\n")
                    await self.flush()
                    continue
                if event is None:
                    break
                self.write(f"id: {event['seq']}\nevent: {event.get('kind')}\ndata: {json.dumps(event)}\n\n")
                await self.flush()
        except StreamClosedError:
            pass
        finally:
            hub.unsubscribe(queue)
        if not self.request.connection.stream.closed():
            self.finish()

    def on_connection_close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)


def _labels_match(record: dict, query: str) -> bool:
    wanted = [v.split("=", 1) for k, v in parse_qsl(query) if k == "label" and "=" in v]
    labels = record.get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted)


def merge_snapshots(parts: list[tuple[Host, list]]) -> list[dict]:
    """One entry per tag: the first host's, with ``host`` and every holder in ``hosts``."""
    out: dict[str, dict] = {}
    for host, items in parts:
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("tag", item.get("id")), str):
                continue
            key = item.get("tag", item.get("id"))
            if key in out:
                out[key]["hosts"].append(host.url)
            else:
                out[key] = {**item, "host": host.url, "hosts": [host.url]}
    return list(out.values())


def lost_snapshots(router: Router, held: set[str], query: str) -> list[dict]:
    """Snapshots known only on hosts that are down (one entry per tag), unless an up host holds them."""
    out: dict[str, dict] = {}
    for rec in router.lost_records("snapshot"):
        if rec["tag"] not in held and _labels_match(rec, query):
            out.setdefault(rec["tag"], {**rec, "hosts": [rec["host"]]})
    return list(out.values())


class TreeHandler(RouterHandler):
    """Every host's tree as one: a ``host`` on every node; a snapshot several hosts hold is one node
    (``hosts`` lists them); sandboxes of a host that is down are nodes with status ``lost``."""

    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/tree" + host_query(self))
        snapshots = merge_snapshots([(h, [n for n in nodes if isinstance(n, dict) and n.get("kind") == "snapshot"])
                                     for h, nodes in parts])
        held = {n["id"] for n in snapshots}
        snapshots += [{"id": r["tag"], "kind": "snapshot", "parent": None, "status": "lost", "pause_ms": None,
                       "pause_us": None, "created_at": None, "engine": r.get("engine"), "lineage": [r["tag"]],
                       "labels": r.get("labels") or {}, "host": r["host"], "hosts": [r["host"]], "lost": r["lost"]}
                      for r in lost_snapshots(self.router, held, self.request.query)]
        sandboxes = [{**n, "host": h.url} for h, nodes in parts for n in nodes
                     if isinstance(n, dict) and n.get("kind") != "snapshot"]
        for rec in self.router.lost_records("sandbox"):
            if not _labels_match(rec, self.request.query):
                continue
            lineage = rec.get("lineage") or [rec.get("snapshot_tag"), rec["id"]]
            sandboxes.append({"id": rec["id"], "kind": "sandbox", "parent": lineage[-2] if len(lineage) > 1 else None,
                              "status": "lost", "pause_ms": None, "pause_us": None,
                              "created_at": rec.get("created_at_unix"), "engine": rec.get("engine"),
                              "lineage": lineage, "labels": rec.get("labels") or {}, "host": rec["host"],
                              "lost": rec["lost"]})
        self.send(snapshots + sandboxes, missing=missing)


# --- snapshots ------------------------------------------------------------------------------------

async def _holder(router: Router, tag: str, engine: str | None = None) -> Host:
    held, _ = await router.holders(tag)
    if engine:
        held = {u: s for u, s in held.items() if s.get("engine") == engine} or held
    if not held:
        raise Refusal(404, f"snapshot {tag} not found on any host of the fleet")
    pinned = [u for u in router.state.hosts_of("snapshot", tag) if u in held]
    return router.hosts[(pinned or list(held))[0]]


class SnapshotsHandler(RouterHandler):
    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/snapshots" + host_query(self))
        merged = merge_snapshots(parts)
        self.send(merged + lost_snapshots(self.router, {s["tag"] for s in merged}, self.request.query), missing=missing)

    async def post(self) -> None:
        """Create: on the host that already has the tag (it answers 409), else best-of-K by free memory."""
        body = self.json_body()
        tag = body.get("tag") if body else None
        held = (await self.router.holders(tag))[0] if isinstance(tag, str) else {}
        host = self.router.hosts[next(iter(held))] if held else self.router.place_new()
        status, reply = await self.call(host)
        if status in (201, 202) and isinstance(reply, dict) and isinstance(reply.get("tag"), str):
            self.router.state.pin("snapshot", [(reply["tag"], None)], host.url, exclusive=False)
            reply["host"] = host.url
        self.answer(status, reply)


class SnapshotPullHandler(RouterHandler):
    async def post(self) -> None:
        """Pull from the store onto the best host that does not hold the tag yet."""
        body = self.json_body() or {}
        held = (await self.router.holders(body["tag"]))[0] if isinstance(body.get("tag"), str) else {}
        host = self.router.place_new(exclude=set(held)) if len(held) < len(self.router.up_hosts()) \
            else self.router.place_new()
        status, reply = await self.call(host)
        if status == 201 and isinstance(reply, dict) and isinstance(reply.get("tag"), str):
            self.router.state.pin("snapshot", [(reply["tag"], None)], host.url, exclusive=False)
            reply["host"] = host.url
        self.answer(status, reply)

    async def delete(self) -> None:  # the snapshot tagged "pull"
        await SnapshotHandler.delete(self, "pull")


class SnapshotHandler(RouterHandler):
    async def delete(self, tag: str) -> None:
        """Delete on every host that holds it."""
        held, _ = await self.router.holders(tag)
        if not held:
            raise Refusal(404, f"snapshot {tag} not found on any host of the fleet")
        answers = await asyncio.gather(*(self.call(self.router.hosts[u]) for u in held))
        for url, (status, _) in zip(held, answers):
            if status in (204, 404):
                self.router.state.unpin("snapshot", tag, url)
        status, reply = next(((s, r) for s, r in answers if s != 204), answers[0])
        self.answer(status, reply)


class SnapshotInfoHandler(RouterHandler):
    async def get(self, tag: str) -> None:
        host = await _holder(self.router, tag)
        status, reply = await self.call(host)
        if isinstance(reply, dict) and status == 200:
            reply["host"] = host.url
        self.answer(status, reply)


class SnapshotCompactHandler(RouterHandler):
    async def post(self, tag: str) -> None:
        host = await _holder(self.router, tag)
        status, reply = await self.call(host)
        if status in (200, 201) and isinstance(reply, dict) and isinstance(reply.get("tag"), str):
            self.router.state.pin("snapshot", [(reply["tag"], None)], host.url, exclusive=False)
            reply["host"] = host.url
        self.answer(status, reply)


class SnapshotPushHandler(RouterHandler):
    async def post(self, tag: str) -> None:
        await self.forward(await _holder(self.router, tag, engine="vm"))


# --- sandboxes ------------------------------------------------------------------------------------

def _count(value) -> int | None:
    """``n`` of a spawn when it is one a host takes (1 to MAX_CHILDREN), else None (a host says why)."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if value == int(value) and 1 <= value <= MAX_CHILDREN else None


class SandboxesHandler(RouterHandler):
    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/sandboxes" + host_query(self))
        items = [{**i, "host": h.url} for h, items in parts for i in items if isinstance(i, dict)]
        items += [r for r in self.router.lost_records("sandbox") if _labels_match(r, self.request.query)]
        self.send(items, missing=missing)

    async def post(self) -> None:
        """Spawn: placement (placement.py), a pull first where a VM snapshot must move, the parts
        side by side; if one part fails the others are killed and its answer is the reply."""
        router = self.router
        body = self.json_body()
        n = _count(body.get("n")) if body else None
        if body is None or not isinstance(body.get("snapshot_tag"), str) or n is None:
            await self.forward(router.place_new())  # a host says exactly what is wrong with it
            return
        tag = body["snapshot_tag"]
        for attempt in (1, 2):
            parts, holders = await router.plan_spawn(tag, n)
            for part in parts:
                if part.pull:
                    await router.ensure_pulled(router.hosts[part.host], tag, holders)
            answers = await asyncio.gather(*(router.spawn_part(p, body, self.client_headers()) for p in parts))
            failed = next(((p, s, r) for p, (s, r) in zip(parts, answers) if s != 201), None)
            if failed is None:
                break
            await asyncio.gather(*(router.kill(router.hosts[p.host], [k["id"] for k in r])
                                   for p, (s, r) in zip(parts, answers) if s == 201))
            part, status, reply = failed
            if status == 503 and attempt == 1 and router.hosts[part.host].capacity is not None:
                router.hosts[part.host].full()  # its figure was stale: place again without it
                continue
            self.answer(status, reply)
            return
        self.send([kid for _, kids in answers for kid in kids], 201)


class PinnedHandler(RouterHandler):
    """A call about one sandbox (workspace, kernel): to the host it is pinned to, as it streams."""

    kind = "sandbox"

    async def locate(self, key: str) -> Host:
        return await self.router.locate(self.kind, key)

    async def get(self, key: str, *_) -> None:
        await self.forward(await self.locate(key))

    post = put = patch = get

    async def delete(self, key: str, *_) -> None:
        await self.forward(await self.locate(key))


class SandboxHandler(PinnedHandler):
    async def get(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        if status == 200 and isinstance(reply, dict):
            reply["host"] = host.url
        elif status == 404:
            self.router.state.unpin("sandbox", sandbox_id, host.url)
        self.answer(status, reply)

    async def delete(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        if status in (204, 404):
            self.router.state.unpin("sandbox", sandbox_id, host.url)
        self.answer(status, reply)


class BranchHandler(PinnedHandler):
    """Branch on the sandbox's host; the new snapshot is pinned there."""

    async def post(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        if status in (201, 202) and isinstance(reply, dict) and isinstance(reply.get("tag"), str):
            self.router.state.pin("snapshot", [(reply["tag"], None)], host.url, exclusive=False)
            reply["host"] = host.url
        self.answer(status, reply)


class ForkHandler(PinnedHandler):
    """A fork tree (branch once, spawn N children of it) on the sandbox's host: the snapshot and the
    children are pinned there."""

    async def post(self, sandbox_id: str) -> None:
        host = await self.locate(sandbox_id)
        status, reply = await self.call(host)
        if status == 201 and isinstance(reply, dict):
            snap, kids = reply.get("snapshot"), reply.get("sandboxes")
            if isinstance(snap, dict) and isinstance(snap.get("tag"), str):
                self.router.state.pin("snapshot", [(snap["tag"], None)], host.url, exclusive=False)
                snap["host"] = host.url
            if isinstance(kids, list):
                self.router.pin_children(host, [k for k in kids if isinstance(k, dict) and isinstance(k.get("id"), str)])
                for k in kids:
                    if isinstance(k, dict):
                        k["host"] = host.url
        self.answer(status, reply)


# --- workspaces and kernels -------------------------------------------------------------------------

class WorkspacesHandler(RouterHandler):
    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/workspaces")
        self.send([{**i, "host": h.url} for h, items in parts for i in items if isinstance(i, dict)], missing=missing)

    async def post(self) -> None:
        body = self.json_body() or {}
        tag = body.get("snapshot_tag")
        host = await _holder(self.router, tag) if isinstance(tag, str) else self.router.place_new()
        status, reply = await self.call(host)
        if status == 201 and isinstance(reply, dict) and isinstance(reply.get("name"), str):
            self.router.state.pin("workspace", [(reply["name"], reply)], host.url)
            reply["host"] = host.url
        self.answer(status, reply)


class WorkspaceHandler(PinnedHandler):
    kind = "workspace"

    async def delete(self, name: str) -> None:
        host = await self.locate(name)
        status, reply = await self.call(host)
        if status in (204, 404):
            self.router.state.unpin("workspace", name, host.url)
        self.answer(status, reply)


class KernelsHandler(RouterHandler):
    async def get(self) -> None:
        parts, missing = await self.router.gather_lists("/v1/kernels")
        self.send([{**i, "host": h.url} for h, items in parts for i in items if isinstance(i, dict)], missing=missing)


class KernelHandler(PinnedHandler):
    """A forkd kernel's record lives on the host of its HEAD sandbox: PUT (and checkout) go there."""

    kind = "kernel"

    async def put(self, kernel_id: str, *_) -> None:
        body = self.json_body() or {}
        sandbox = body.get("head") if self.request.method == "PUT" else body.get("sandbox")
        if not isinstance(sandbox, str):
            await self.forward(await self.locate(kernel_id))
            return
        host = await self.router.locate("sandbox", sandbox)
        self.router.state.pin("kernel", [(kernel_id, None)], host.url)
        await self.forward(host)

    post = put

    async def delete(self, kernel_id: str) -> None:
        host = await self.locate(kernel_id)
        status, reply = await self.call(host)
        if status in (204, 404):
            self.router.state.unpin("kernel", kernel_id, host.url)
        self.answer(status, reply)


class NotFoundHandler(RouterHandler):
    def _missing(self, *args) -> None:
        raise Refusal(404, f"not found: {self.request.path} is not a route of forkd's /v1")

    get = post = put = patch = delete = _missing


ID = r"([^/]+)"


def route_table() -> list[tuple[str, type]]:
    from .session import SessionProxy

    return [
        (r"/healthz/?", HealthHandler),
        (r"/version", VersionHandler),
        (r"/metrics", MetricsHandler),
        (r"/v1/openapi\.json", OpenAPIHandler),
        (r"/v1/fleet/hosts", HostsHandler),
        (r"/v1/events", EventsHandler),
        (r"/v1/tree", TreeHandler),
        (r"/v1/snapshots", SnapshotsHandler),
        (r"/v1/snapshots/pull", SnapshotPullHandler),
        (rf"/v1/snapshots/{ID}", SnapshotHandler),
        (rf"/v1/snapshots/{ID}/info", SnapshotInfoHandler),
        (rf"/v1/snapshots/{ID}/compact", SnapshotCompactHandler),
        (rf"/v1/snapshots/{ID}/push", SnapshotPushHandler),
        (r"/v1/sandboxes", SandboxesHandler),
        (rf"/v1/sandboxes/{ID}", SandboxHandler),
        (rf"/v1/sandboxes/{ID}/branch", BranchHandler),
        (rf"/v1/sandboxes/{ID}/fork", ForkHandler),
        (rf"/v1/sandboxes/{ID}/session", SessionProxy),
        (rf"/v1/sandboxes/{ID}/(ping|exec|eval|run|interrupt|inventory|memory|files|promote)", PinnedHandler),
        (r"/v1/kernels", KernelsHandler),
        (rf"/v1/kernels/{ID}", KernelHandler),
        (rf"/v1/kernels/{ID}/checkout", KernelHandler),
        (r"/v1/workspaces", WorkspacesHandler),
        (rf"/v1/workspaces/{ID}", WorkspaceHandler),
        (rf"/v1/workspaces/{ID}/(suspend|resume)", WorkspaceHandler),
        (r"/.*", NotFoundHandler),
    ]
