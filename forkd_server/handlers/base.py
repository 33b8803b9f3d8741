"""The base of every forkd handler: forkd's auth answers and ``{"error"}`` bodies, the thread the
controller runs in, and the request-body check (forkd's extractor: 415, 400, 422 before anything else).

Wire rules (reference/forkd-api.md): every error body is ``{"error": "..."}``; a missing or wrong
token answers 401 (``missing bearer token`` / ``invalid bearer token``), not jupyter_server's 403;
``/healthz`` needs no token; request bodies are checked before anything else (415 without a JSON
content type, 400 for malformed JSON, 422 for a missing field or a wrong type), then the controller
applies forkd's check order.
"""

from __future__ import annotations

import asyncio
import functools
import json

from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from ..errors import ForkdError
from ..wire import label_filter

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

# A body spec maps each field to (JSON type, required). Types: string, integer, number, boolean,
# string[], string[][], env.


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
    if kind in ("env", "labels"):  # string -> string
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    raise ValueError(kind)


class ApiError(web.HTTPError):
    """An HTTP error whose body is ``{"error": message}`` (the message is never %-formatted)."""

    def __init__(self, status: int, message: str, fields: dict | None = None):
        super().__init__(status, "%s", message)
        self.message = message
        self.fields = fields or {}


def query_bool(handler: web.RequestHandler, name: str) -> bool:
    raw = handler.get_query_argument(name, "false")
    if raw not in ("true", "false"):
        raise ApiError(400, f"invalid query parameter {name}={raw!r}: use true or false")
    return raw == "true"


def query_labels(handler: web.RequestHandler) -> dict[str, str]:
    """The repeatable ``?label=key=value`` filter (every pair must match)."""
    try:
        return label_filter(handler.get_query_arguments("label"))
    except ForkdError as exc:
        raise ApiError(exc.status, exc.message) from None


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
        self.finish(json.dumps({"error": message, **(exc.fields if isinstance(exc, ApiError) else {})}))

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
            raise ApiError(exc.status, exc.message, exc.fields) from None

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


class NotFoundHandler(ForkdHandler):
    """Unknown paths under v1/: 401 without a token (forkd authenticates before routing), else 404."""

    def _missing(self, *args) -> None:
        self.set_status(404)
        self.finish()

    get = post = put = delete = web.authenticated(_missing)
