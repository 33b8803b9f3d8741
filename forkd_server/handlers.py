"""Thin tornado handlers for forkd's /v1 API: parse, call the controller in a thread, map errors.

Wire rules (reference/forkd-api.md): every error body is ``{"error": "..."}``; a missing or wrong
token answers 401 (``missing bearer token`` / ``invalid bearer token``), not jupyter_server's 403;
``/healthz`` needs no token; request bodies are checked before anything else (415 without a JSON
content type, 400 for malformed JSON, 422 for a missing field or a wrong type), then the controller
applies forkd's check order.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import time

from jupyter_server.auth.decorator import allow_unauthenticated, authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from tornado import web
from tornado.iostream import StreamClosedError

from . import __version__
from .controller import check_tag
from .errors import BadRequest, ForkdError
from .session_handler import SessionHandler

OPENAPI_PATH = os.path.join(os.path.dirname(__file__), "openapi.json")

try:  # 5-10x faster than json.dumps on a list of 1000 sandboxes; the stdlib is the fallback
    import orjson

    def dumps(obj) -> bytes:
        try:
            return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:
            return json.dumps(obj).encode()
except ImportError:  # pragma: no cover
    def dumps(obj) -> bytes:
        return json.dumps(obj).encode()

# --- request bodies -----------------------------------------------------------------------------
# name -> (JSON type, required). Types: string, integer, number, boolean, string[], string[][], env.
SNAPSHOT_CREATE = {
    "tag": ("string", True), "engine": ("string", False), "setup": ("string", False),
    "setup_commands": ("string[][]", False), "mem_size_mib": ("integer", False),
    "host_network": ("boolean", False), "disk_mib": ("integer", False), "packages": ("string[]", False),
    "shell": ("string", False), "lossy": ("boolean", False),
    # forkd's own form (kernel + rootfs) selects the VM engine
    "kernel": ("string", False), "rootfs": ("string", False), "rw": ("boolean", False),
    "tap": ("string", False), "boot_wait_secs": ("integer", False),
}
SPAWN = {
    "snapshot_tag": ("string", True), "n": ("integer", False), "per_child_netns": ("boolean", False),
    "memory_limit_mib": ("integer", False), "prewarm": ("boolean", False), "live_fork": ("boolean", False),
    "hugepages": ("boolean", False),
}
EXEC = {"args": ("string[]", True), "timeout_secs": ("number", False), "env": ("env", False),
        "cwd": ("string", False)}
EVAL = {"code": ("string", True)}
RUN = {"code": ("string", True), "timeout": ("number", False)}
BRANCH = {
    "tag": ("string", False), "mode": ("string", False), "diff": ("boolean", False), "live": ("boolean", False),
    "measure_diff": ("boolean", False), "wait": ("boolean", False), "parent_tag": ("string", False),
}
COMPACT = {"to": ("string", True)}
WORKSPACE_CREATE = {"name": ("string", True), "snapshot_tag": ("string", True),
                    "per_child_netns": ("boolean", False), "memory_limit_mib": ("integer", False)}
SUSPEND = {"diff": ("boolean", False)}


def _is(kind: str, value) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string[]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "string[][]":
        return isinstance(value, list) and all(_is("string[]", v) for v in value)
    if kind == "env":
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    raise ValueError(kind)


class ApiError(web.HTTPError):
    """An HTTP error whose body is ``{"error": message}`` (the message is never %-formatted)."""

    def __init__(self, status: int, message: str):
        super().__init__(status, "%s", message)
        self.message = message


def _query_bool(handler: web.RequestHandler, name: str) -> bool:
    raw = handler.get_query_argument(name, "false")
    if raw not in ("true", "false"):
        raise ApiError(400, f"invalid query parameter {name}={raw!r}: use true or false")
    return raw == "true"


# --- base handler -------------------------------------------------------------------------------

class ForkdHandler(ExtensionHandlerMixin, APIHandler):
    """Base of every forkd route: forkd's auth answers and error bodies, a thread for the controller."""

    auth_resource = "forkd:server"
    public = False  # only /healthz
    body_spec: dict | None = None  # the JSON body a POST takes (checked like forkd's extractor)

    @property
    def app(self):
        return self.extensionapp

    @property
    def controller(self):
        return self.extensionapp.controller

    def _credential_sent(self) -> bool:
        header = self.request.headers.get("Authorization", "")
        return bool(header.strip()) and header.split(None, 1)[0].lower() in ("bearer", "token") \
            or bool(self.get_query_argument("token", ""))

    def _unauthorized(self) -> ApiError:
        return ApiError(401, "invalid bearer token" if self._credential_sent() else "missing bearer token")

    async def prepare(self) -> None:
        if self.app.events.loop is None:
            self.app.events.loop = asyncio.get_running_loop()
        try:
            await super().prepare()
        except web.HTTPError as exc:
            # jupyter_server answers "no user" with 403 (login redirect, @authenticated, XSRF):
            # forkd answers 401 before anything else.
            if exc.status_code == 403 and getattr(self, "_jupyter_current_user", None) is None and not self.public:
                raise self._unauthorized() from None
            raise
        if not self.public and self.current_user is None:
            raise self._unauthorized()

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        if status_code == 403 and getattr(self, "_jupyter_current_user", None) is None and not self.public:
            status_code, exc = 401, self._unauthorized()
            self.set_status(401)
        if isinstance(exc, ApiError):
            message = exc.message
        elif isinstance(exc, web.HTTPError):
            message = (exc.log_message % exc.args) if exc.log_message else (exc.reason or self._reason)
        else:
            message = "internal error" if exc is None else f"internal error: {type(exc).__name__}: {exc}"
        self.clear_header("Content-Type")
        self.finish(json.dumps({"error": message}))

    def compute_etag(self):
        # Replies describe live state and are never revalidated; hashing every reply (a listing of
        # 1000 sandboxes is ~350 KB) would only cost time.
        return None

    def send(self, body, status: int = 200) -> None:
        self.set_status(status)
        self.finish(dumps(body))

    def no_content(self) -> None:
        self.set_status(204)
        self.finish()

    async def call(self, fn, *args, **kwargs):
        """Run a blocking controller method on the app's thread pool; ForkdError -> {"error"}."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.app.executor, functools.partial(fn, *args, **kwargs))
        except ForkdError as exc:
            raise ApiError(exc.status, exc.message) from None

    def body(self, spec: dict) -> dict:
        """Parse and type-check a JSON body, the way forkd's extractor does (before any other check)."""
        ctype = self.request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
            raise ApiError(415, "expected request with `Content-Type: application/json`")
        raw = self.request.body.strip()
        if not raw:
            raise ApiError(400, "invalid JSON body: the body is empty (send {} when every field is optional)")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(422, "the body must be a JSON object")
        for name, (kind, required) in spec.items():
            if data.get(name) is None:
                if required:
                    raise ApiError(422, f"missing field `{name}`")
                data.pop(name, None)
            elif not _is(kind, data[name]):
                raise ApiError(422, f"invalid type for field `{name}`: expected {kind}")
        return {k: v for k, v in data.items() if k in spec}


# --- meta ---------------------------------------------------------------------------------------

class HealthHandler(ForkdHandler):
    public = True

    @allow_unauthenticated
    def get(self) -> None:
        self.send({"ok": True})


class VersionHandler(ForkdHandler):
    @web.authenticated
    @authorized
    def get(self) -> None:
        self.send({"version": __version__, "api": "v1"})


class MetricsHandler(ForkdHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        text = await self.call(generate_latest, self.app.metrics.registry)
        self.finish(text, set_content_type=CONTENT_TYPE_PLAIN_0_0_4)


class OpenAPIHandler(ForkdHandler):
    @web.authenticated
    @authorized
    def get(self) -> None:
        with open(OPENAPI_PATH) as f:
            doc = json.load(f)
        doc["servers"] = [{"url": self.base_url.rstrip("/") + "/" + self.app.route_prefix.rstrip("/")}]
        self.send(doc)


class EventsHandler(ForkdHandler):
    """Server-sent events: one ``data:`` line of JSON per change (created, status, killed, deleted)."""

    auth_resource = "forkd:events"
    _queue = None

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        hub = self.app.events
        self._queue = queue = hub.subscribe()
        try:
            self.write(": forkd events\n\n")
            await self.flush()
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), self.app.sse_keepalive)
                except asyncio.TimeoutError:
                    self.write(": keep-alive\n\n")
                    await self.flush()
                    continue
                if event is None:  # the server or the client is going away
                    break
                self.write(f"id: {event['seq']}\nevent: {event['kind']}\ndata: {dumps(event).decode()}\n\n")
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


class TreeHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        with_memory, with_busy = _query_bool(self, "memory"), _query_bool(self, "busy")
        nodes = await self.call(self.controller.tree)
        sandboxes = [n for n in nodes if n["kind"] == "sandbox"]
        # one request for the whole tree instead of one per sandbox (the lab panel shows all of them)
        if with_memory:
            await self.call(self._add_memory, sandboxes)
        if with_busy:  # one agent round trip each, side by side: a slow sandbox costs its own ping only
            await asyncio.gather(*(self.call(self._add_busy, n) for n in sandboxes))
        self.send(nodes)

    def _add_memory(self, sandboxes: list[dict]) -> None:
        for node in sandboxes:
            try:
                node["memory"] = self.controller.memory(node["id"])
            except ForkdError:  # gone since the listing: the event says so
                node["memory"] = None

    def _add_busy(self, node: dict) -> None:
        try:
            node["busy"] = self.controller.ping(node["id"]).get("busy")
        except ForkdError:
            node["busy"] = None


# --- snapshots ----------------------------------------------------------------------------------

class SnapshotsHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"
    body_spec = SNAPSHOT_CREATE  # the JSON body of post

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send(await self.call(self.controller.list_snapshots))

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        body = self.body(self.body_spec)
        engine = body.get("engine", "auto")
        if "kernel" in body or "rootfs" in body:  # forkd's form: a VM booted from kernel + rootfs
            try:
                check_tag(body["tag"])
            except BadRequest as exc:
                raise ApiError(400, exc.message) from None
            for what in ("kernel", "rootfs"):
                if not os.path.exists(body.get(what, "")):
                    raise ApiError(400, f"{what} not found: {body.get(what, '')}")
            if body.get("boot_wait_secs", 10) > 60:
                raise ApiError(400, "boot_wait_secs must be at most 60")
            engine = "vm"
        info = await self.call(self.controller.create_snapshot, body["tag"], engine=engine,
                               setup=body.get("setup"), setup_commands=body.get("setup_commands"),
                               mem_size_mib=body.get("mem_size_mib"), host_network=body.get("host_network", False),
                               disk_mib=body.get("disk_mib"), packages=body.get("packages"),
                               shell=body.get("shell", "plain"), lossy=body.get("lossy", False))
        if "kernel" in body or "rootfs" in body:
            # Say so rather than pretend: the VM runs forkd's own guest (its agent speaks our protocol).
            info["warning"] = ("kernel and rootfs were checked, but the VM boots this server's guest image "
                               "(`forkd image build`); add software with packages, setup_commands or disk_mib")
        self.send(info, 201)


class SnapshotHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"

    @web.authenticated
    @authorized
    async def delete(self, tag: str) -> None:
        cascade, force = _query_bool(self, "cascade"), _query_bool(self, "force")
        await self.call(self.controller.delete_snapshot, tag, cascade=cascade, force=force)
        self.no_content()


class SnapshotInfoHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"

    @web.authenticated
    @authorized
    async def get(self, tag: str) -> None:
        self.send(await self.call(self.controller.snapshot_detail, tag))


class SnapshotCompactHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"
    body_spec = COMPACT  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, tag: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.call(self.controller.compact_snapshot, tag, body["to"]))  # 200, as in forkd


# --- sandboxes ----------------------------------------------------------------------------------

class SandboxesHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    body_spec = SPAWN  # the JSON body of post

    @web.authenticated
    @authorized
    async def get(self) -> None:
        gen, infos, live = await self.call(self.controller.sandbox_listing)
        # Each sandbox's JSON is encoded once per registry generation and reused until it changes.
        cached = self.app.listing_json
        if cached is None or cached[0] != gen:
            cached = self.app.listing_json = (gen, [dumps(info) for info in infos])
        self.set_status(200)
        self.finish(b"[" + b",".join(part for part, ok in zip(cached[1], live) if ok) + b"]")

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        body = self.body(self.body_spec)
        options = {k: body[k] for k in ("per_child_netns", "prewarm", "live_fork", "hugepages") if k in body}
        t0 = time.perf_counter()
        out = await self.call(self.controller.spawn, body["snapshot_tag"], body.get("n", 1),
                              memory_limit_mib=body.get("memory_limit_mib"), **options)
        self.app.metrics.spawn_latency.observe(time.perf_counter() - t0)
        self.send(out, 201)


class SandboxHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"

    @web.authenticated
    @authorized
    async def get(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.get_sandbox, sandbox_id))

    @web.authenticated
    @authorized
    async def delete(self, sandbox_id: str) -> None:
        await self.call(self.controller.kill_sandbox, sandbox_id)
        self.no_content()


class PingHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"

    @web.authenticated
    @authorized(action="read")
    async def post(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.ping, sandbox_id))


class ExecHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    body_spec = EXEC  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.call(self.controller.exec, sandbox_id, body["args"], body.get("timeout_secs", 30),
                                  env=body.get("env"), cwd=body.get("cwd")))


class EvalHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    body_spec = EVAL  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.call(self.controller.eval, sandbox_id, body["code"]))


class RunHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    body_spec = RUN  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        kwargs = {"timeout": body["timeout"]} if "timeout" in body else {}
        self.send(await self.call(self.controller.run_code, sandbox_id, body["code"], **kwargs))


class BranchHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    body_spec = BRANCH  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        wait = body.get("wait", True)
        info = await self.call(self.controller.branch, sandbox_id, body.get("tag"), mode=body.get("mode"),
                               diff=body.get("diff", False), live=body.get("live", False),
                               measure_diff=body.get("measure_diff", False), wait=wait,
                               parent_tag=body.get("parent_tag"))
        if info.get("pause_ms") is not None:
            self.app.metrics.branch_pause.observe(info["pause_ms"] / 1000)
        self.send(info, 202 if not wait else 201)


class InterruptHandler(ForkdHandler):
    """No body: interrupt the cell the sandbox is running (a KeyboardInterrupt in it)."""

    auth_resource = "forkd:sandboxes"

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.interrupt, sandbox_id))


class MemoryHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"

    @web.authenticated
    @authorized
    async def get(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.memory, sandbox_id))


class FilesHandler(ForkdHandler):
    """``GET`` reads a file (or lists a directory), ``PUT`` writes the raw body, ``DELETE`` removes."""

    auth_resource = "forkd:sandboxes"

    def _path(self) -> str:
        path = self.get_query_argument("path", "")
        if not path:
            raise ApiError(400, "the path query parameter is required, e.g. ?path=/tmp/data.csv")
        return path

    @web.authenticated
    @authorized
    async def get(self, sandbox_id: str) -> None:
        path = self._path()
        try:
            self.send(await self.call(self.controller.files, sandbox_id, "read", path))
        except ApiError as exc:
            if exc.status_code != 400 or not exc.message.startswith("IsADirectoryError"):
                raise
            self.send(await self.call(self.controller.files, sandbox_id, "list", path))

    @web.authenticated
    @authorized(action="execute")
    async def put(self, sandbox_id: str) -> None:
        path = self._path()
        options = {"append": _query_bool(self, "append")}
        mode = self.get_query_argument("mode", None)
        if mode is not None:
            try:
                options["mode"] = int(mode, 8)
            except ValueError:
                raise ApiError(400, f"invalid query parameter mode={mode!r}: use octal, e.g. 644") from None
        data = base64.b64encode(self.request.body).decode()
        self.send(await self.call(self.controller.files, sandbox_id, "write", path, data_b64=data, **options))

    @web.authenticated
    @authorized(action="execute")
    async def delete(self, sandbox_id: str) -> None:
        path = self._path()
        recursive = _query_bool(self, "recursive")
        await self.call(self.controller.files, sandbox_id, "remove", path, recursive=recursive)
        self.no_content()


# --- workspaces ---------------------------------------------------------------------------------

class WorkspacesHandler(ForkdHandler):
    auth_resource = "forkd:workspaces"
    body_spec = WORKSPACE_CREATE  # the JSON body of post

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send(await self.call(self.controller.list_workspaces))

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        body = self.body(self.body_spec)
        self.send(await self.call(self.controller.create_workspace, body["name"], body["snapshot_tag"],
                                  memory_limit_mib=body.get("memory_limit_mib")), 201)


class WorkspaceHandler(ForkdHandler):
    auth_resource = "forkd:workspaces"

    @web.authenticated
    @authorized
    async def get(self, name: str) -> None:
        self.send(await self.call(self.controller.get_workspace, name))

    @web.authenticated
    @authorized
    async def delete(self, name: str) -> None:
        await self.call(self.controller.delete_workspace, name)
        self.no_content()


class WorkspaceSuspendHandler(ForkdHandler):
    auth_resource = "forkd:workspaces"
    body_spec = SUSPEND  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, name: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.call(self.controller.suspend_workspace, name, diff=body.get("diff", False)))


class WorkspaceResumeHandler(ForkdHandler):
    """No body, like ping: whatever is sent is ignored."""

    auth_resource = "forkd:workspaces"

    @web.authenticated
    @authorized(action="execute")
    async def post(self, name: str) -> None:
        self.send(await self.call(self.controller.resume_workspace, name))


class NotFoundHandler(ForkdHandler):
    """Unknown paths under v1/: 401 without a token (forkd authenticates before routing), else 404."""

    def _missing(self, *args) -> None:
        self.set_status(404)
        self.finish()

    get = post = put = delete = web.authenticated(_missing)


# --- the route table ----------------------------------------------------------------------------

ID = r"([^/]+)"


def route_table(prefix: str) -> list[tuple[str, type]]:
    """Every route, relative to base_url. ``prefix`` is 'forkd/' in jupyter lab, '' for forkd serve."""
    from .kernel_handlers import KernelHandler, KernelsHandler  # they build on this module
    routes = [
        (r"healthz/?", HealthHandler),
        (r"version", VersionHandler),
        (r"metrics", MetricsHandler),
        (r"v1/openapi\.json", OpenAPIHandler),
        (r"v1/events", EventsHandler),
        (r"v1/tree", TreeHandler),
        (r"v1/snapshots", SnapshotsHandler),
        (rf"v1/snapshots/{ID}", SnapshotHandler),
        (rf"v1/snapshots/{ID}/info", SnapshotInfoHandler),
        (rf"v1/snapshots/{ID}/compact", SnapshotCompactHandler),
        (r"v1/sandboxes", SandboxesHandler),
        (rf"v1/sandboxes/{ID}", SandboxHandler),
        (rf"v1/sandboxes/{ID}/ping", PingHandler),
        (rf"v1/sandboxes/{ID}/exec", ExecHandler),
        (rf"v1/sandboxes/{ID}/eval", EvalHandler),
        (rf"v1/sandboxes/{ID}/run", RunHandler),
        (rf"v1/sandboxes/{ID}/branch", BranchHandler),
        (rf"v1/sandboxes/{ID}/interrupt", InterruptHandler),
        (rf"v1/sandboxes/{ID}/session", SessionHandler),
        (rf"v1/sandboxes/{ID}/memory", MemoryHandler),
        (rf"v1/sandboxes/{ID}/files", FilesHandler),
        (r"v1/kernels", KernelsHandler),
        (rf"v1/kernels/{ID}", KernelHandler),
        (r"v1/workspaces", WorkspacesHandler),
        (rf"v1/workspaces/{ID}", WorkspaceHandler),
        (rf"v1/workspaces/{ID}/suspend", WorkspaceSuspendHandler),
        (rf"v1/workspaces/{ID}/resume", WorkspaceResumeHandler),
        (r"v1/.*", NotFoundHandler),
    ]
    return [("/" + prefix + pattern, handler) for pattern, handler in routes]
