"""The base of every forkd handler: forkd's auth answers and ``{"error"}`` bodies, the pools the
controller runs on (admission.py decides which, and what is refused), bounded request bodies and
the body check (forkd's extractor: 415, 400, 422 before anything else).

Wire rules (reference/forkd-api.md): every error body is ``{"error": "..."}``; a missing or wrong
token answers 401 (``missing bearer token`` / ``invalid bearer token``), not jupyter_server's 403;
``/healthz`` needs no token; request bodies are checked before anything else (413 past the size
limit, 415 without a JSON content type, 400 for malformed JSON, 422 for a missing field or a wrong
type, 400 for a number outside its range), then the controller applies forkd's check order.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math

import orjson
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from ..errors import ForkdError, Gone, NotFound, internal_error
from ..hub.identity import HubUser
from ..hub.ownership import Caller, Refused
from ..scrub import ScrubbedLog, scrub  # noqa: F401 - the names this module's users import
from ..controller.checks import HOST_MEMORY
from ..controller.storage import full_disk_error, is_disk_full
from ..controller.wire import label_filter


def dumps(obj) -> bytes:
    """orjson: 5-10x faster than json.dumps on a list of 1000 sandboxes."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(obj).encode()


CLIENT_HEADER = "X-Forkd-Client"  # the SDK sends a random id per client object


def caller_of(handler) -> str:
    """Whose long calls a request's are (any authenticated jupyter handler: REST routes and the
    session WebSocket alike): the token it sent (its hash, never the token), else the user; and
    within that, the client that says who it is with ``X-Forkd-Client``, so that clients sharing
    one token (every client of ``forkd serve``) each have a cap of their own. Clients that send no
    such header share their token's."""
    token = handler.identity_provider.get_token(handler) if handler.token_authenticated else None
    if token:
        caller = "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    else:
        user = handler.current_user
        caller = "user:" + (getattr(user, "username", None) or "anonymous")
    client = handler.request.headers.get(CLIENT_HEADER, "")
    return caller + "/client:" + hashlib.sha256(client.encode()).hexdigest()[:16] if client else caller


MIB = 1 << 20
# A body spec maps each field to (JSON type, required) or (JSON type, required, range), the range
# in JSON Schema's words (minimum, maximum, exclusiveMinimum), as openapi.json states it. Types:
# string, integer (>= 0 unless its range says more; 3.0 counts), number (finite), boolean, string[],
# string[][], env, labels, mib (an integer, or "host": all of the host's memory).


def _is(kind: str, value) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":  # JSON Schema's integer: 3.0 is one (taken as 3)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and value == int(value) and value >= 0
    if kind == "mib":
        return value == HOST_MEMORY or _is("integer", value)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "string[]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "string[][]":
        return isinstance(value, list) and all(_is("string[]", v) for v in value)
    if kind in ("env", "labels"):  # string -> string
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    raise ValueError(kind)


async def in_forkd_words(handler, login) -> None:
    """``login``, jupyter_server's own check of ``handler``'s caller (awaited here), answered in
    forkd's words: jupyter_server answers "no user" with 403 (login redirect, @authenticated, XSRF),
    forkd with 401 before anything else. ``handler`` has ``public`` and ``_unauthorized()``."""
    try:
        await login
    except web.HTTPError as exc:
        if exc.status_code == 403 and getattr(handler, "_jupyter_current_user", None) is None and not handler.public:
            raise handler._unauthorized() from None
        raise
    if not handler.public and handler.current_user is None:
        raise handler._unauthorized()


class ApiError(web.HTTPError):
    """An HTTP error whose body is ``{"error": message}`` (the message is never %-formatted)."""

    def __init__(self, status: int, message: str, fields: dict | None = None):
        super().__init__(status, "%s", message)
        self.message = message
        self.fields = fields or {}


async def settled(app, call, sandbox: str | None):
    """Await ``call``, a controller call of ``app`` (the extension: its controller and admission);
    every failure becomes the ``ApiError`` its route answers, never a bare 500 for what a user can
    fix: a full disk is 507, a sandbox killed during the call is 410. What is not one of ours is
    raised as it is (a 500 saying so)."""
    try:
        return await call
    except ForkdError as exc:
        failure = exc
    except Exception as exc:  # noqa: BLE001 - explained below when it is one of ours, else re-raised
        failure = exc
    if is_disk_full(failure):
        error = full_disk_error(app.controller.data_dir, failure)
        raise ApiError(error.status, error.message, error.fields) from None
    status = failure.status if isinstance(failure, ForkdError) else 500
    gone = await _sandbox_gone(app, sandbox) if status == 500 and sandbox is not None else None
    if gone is not None:
        ended = gone.fields.get("ended") or {}
        why = ended.get("reason") or "killed, or its process exited"
        error = Gone(f"sandbox {sandbox} ended during this call: {why}", hint=gone.hint,
                     details={**gone.details, "call": getattr(failure, "message", str(failure))},
                     **({"ended": ended} if ended else {}))
        raise ApiError(410, error.message, error.fields) from None
    if not isinstance(failure, ForkdError):
        raise failure
    raise ApiError(failure.status, failure.message, failure.fields) from None


async def _sandbox_gone(app, sandbox: str) -> NotFound | None:
    """The 404 of ``sandbox`` if it is gone (saying why, when known), else None."""
    try:
        await app.admission.control(functools.partial(app.controller.get_sandbox, sandbox))
    except NotFound as exc:
        return exc
    except Exception:  # noqa: BLE001 - cannot tell: the original error stands
        return None
    return None


def query_bool(handler: web.RequestHandler, name: str) -> bool:
    raw = handler.get_query_argument(name, "false")
    if raw not in ("true", "false"):
        raise ApiError(400, f"invalid query parameter {name}={raw!r}: use true or false")
    return raw == "true"


def query_labels(handler: web.RequestHandler) -> dict[str, str]:
    """The repeatable ``?label=key=value`` filter (every pair must match)."""
    try:
        return label_filter(handler.get_query_arguments("label", strip=False))  # exact, spaces included
    except ForkdError as exc:
        raise ApiError(exc.status, exc.message, exc.fields) from None


def out_of_range(name: str, value, bounds: dict) -> str | None:
    """Why ``value`` is outside ``bounds`` (JSON Schema's minimum/maximum/exclusiveMinimum), or None."""
    low, high = bounds.get("minimum"), bounds.get("maximum")
    above = bounds.get("exclusiveMinimum")
    if (low is not None and value < low) or (high is not None and value > high) or \
            (above is not None and value <= above):
        lower = f"more than {above}" if above is not None else f"at least {low}" if low is not None else ""
        upper = f"at most {high}" if high is not None else ""
        return f"field `{name}` must be {' and '.join(p for p in (lower, upper) if p)}, got {value!r:.40}"
    return None


@web.stream_request_body
class ForkdHandler(ScrubbedLog, ExtensionHandlerMixin, APIHandler):
    """Base of every forkd route: forkd's auth answers and error bodies, the controller on a pool.

    Bodies are streamed in and kept up to ``max_body_bytes``; past it the rest is read and dropped
    (so the client gets its answer rather than a reset) and the route answers 413.
    """

    auth_resource = "forkd:server"
    public = False  # only /healthz
    # Under JupyterHub (forkd_server/hub/): the object the route's first path argument names, which
    # the caller must see (else 404), and the methods that change it (else 403 when only seen).
    owned: str | None = None  # "sandbox", "snapshot" or "workspace"
    changes: tuple[str, ...] = ()
    body_spec: dict | None = None  # the JSON body a POST takes (checked like forkd's extractor)
    max_body_bytes = 16 * MIB
    _received = 0
    _chunks: list | None = None

    @property
    def app(self):
        return self.extensionapp

    @property
    def controller(self):
        return self.extensionapp.controller

    _let_in: dict = {}  # Host headers jupyter_server's Host check let in, with the settings it used
    LET_IN_KEPT = 64

    @staticmethod
    def _host_key(host: str, settings: dict) -> tuple:
        return host, settings.get("allow_remote_access", False), tuple(settings.get("local_hostnames", ()))

    @classmethod
    def host_let_in(cls, host: str, settings: dict) -> bool:
        """Whether ``check_host`` let ``host`` in before under these settings (plain_ping.py)."""
        return cls._host_key(host, settings) in cls._let_in

    def check_host(self) -> bool:
        """jupyter_server's Host check (against DNS rebinding), its yes remembered per Host header
        and settings: it parses the address afresh each time, ~2% of a ping's CPU. A no, or a Host
        naming a Unix socket (checked on disk), is asked every time, and logged as before."""
        host = self.request.host
        key = self._host_key(host, self.settings)
        if key in self._let_in:
            return True
        allowed = super().check_host()
        if allowed and "%" not in host and not host.startswith("/") and len(self._let_in) < self.LET_IN_KEPT:
            self._let_in[key] = True
        return allowed

    def _token_in_header(self) -> bool:
        header = self.request.headers.get("Authorization", "")
        return bool(header.strip()) and header.split(None, 1)[0].lower() in ("bearer", "token")

    def _credential_sent(self) -> bool:
        return self._token_in_header() or bool(self.get_query_argument("token", ""))

    def set_signed_cookie(self, name, value, expires_days=30, version=None, **kwargs) -> None:
        """No login cookie for a call that brings its token in the ``Authorization`` header: it
        brings it every time. jupyter_server's identity provider signs and sets one on every such
        call (for a fresh anonymous user, to a client that keeps no cookies, as the SDK), and a
        client that keeps them (the mcp SDK's httpx) sends it back with every call after, both sides
        paying for it. A browser's login (a form, ``?token=`` in a URL) still gets its cookie."""
        if not self._token_in_header():
            super().set_signed_cookie(name, value, expires_days, version, **kwargs)

    set_secure_cookie = set_signed_cookie  # jupyter_server's name for it (tornado's alias, bound here too)

    def _unauthorized(self) -> ApiError:
        return ApiError(401, "invalid bearer token" if self._credential_sent() else "missing bearer token")

    async def prepare(self) -> None:
        if self.app.events.loop is None:
            self.app.events.loop = asyncio.get_running_loop()
        await self.authenticate()
        if not self.public and isinstance(self.current_user, HubUser):
            await self._hub_checks()

    async def authenticate(self) -> None:
        """jupyter_server's own check of the caller, answered in forkd's words (401, not 403)."""
        await in_forkd_words(self, super().prepare())

    # --- under JupyterHub: who the caller is and what they may touch (forkd_server/hub/) -------------

    @property
    def hub_caller(self) -> Caller | None:
        """The Hub user a request acts for (None: the server's own token, or no Hub): what they make
        is theirs (``Caller.stamp``)."""
        user = self.current_user
        if isinstance(user, HubUser) and not user.operator:
            return Caller(user.username, admin=user.admin)
        return None

    @property
    def viewer(self) -> Caller | None:
        """The caller whose view is limited to their own objects (None: one who sees everything)."""
        caller = self.hub_caller
        return caller if caller is not None and not caller.admin else None

    def stamped(self, labels: dict | None) -> dict | None:
        """The labels of what this request makes: the Hub caller's owner label set by the server."""
        caller = self.hub_caller
        if caller is None:
            return labels
        try:
            return caller.stamp(labels)
        except Refused as exc:
            raise ApiError(exc.status, exc.message) from None

    def check_new_labels(self, labels: dict | None) -> None:
        """Labels added to an object: never the server's, from a user."""
        caller = self.hub_caller
        if caller is not None:
            try:
                caller.check_labels(labels)
            except Refused as exc:
                raise ApiError(exc.status, exc.message) from None

    async def _hub_checks(self) -> None:
        why = getattr(self.authorizer, "refusal", lambda *a: None)(self.current_user, self.auth_resource)
        if why:
            raise ApiError(403, why)
        if self.owned and self.path_args:
            await self.own(self.owned, self.path_args[0], change=self.request.method in self.changes)

    async def own(self, kind: str, key: str, *, change: bool = False, gone_ok: bool = False) -> dict | None:
        """Check that the caller sees the sandbox, snapshot or workspace ``key`` (404 as if there were
        none, so ids do not leak) and, with ``change``, may change it (403); returns its info (None
        when the caller sees everything). ``gone_ok``: a sandbox of the caller's that ended is
        returned (its end's record) rather than answered 404."""
        viewer = self.viewer
        if viewer is None:
            return None
        get = {"sandbox": self.controller.get_sandbox, "snapshot": self.controller.get_snapshot,
               "workspace": self.controller.get_workspace}[kind]
        try:
            info = await self.call(get, key)
        except ApiError as exc:
            if exc.status_code != 404:
                raise
            # gone: how it ended is told to its owner, to others it is an unknown id
            ended = await self.call(self.controller.registry.ended_sandbox, key) if kind == "sandbox" else None
            if ended is not None and viewer.sees(ended.get("labels")):
                if gone_ok:
                    return ended
                raise
            info = None
        try:
            viewer.check(kind, key, None if info is None else info.get("labels") or {}, change=change)
        except Refused as exc:
            raise ApiError(exc.status, exc.message) from None
        return info

    def data_received(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._received <= self.max_body_bytes:
            if self._chunks is None:
                self._chunks = []
            self._chunks.append(chunk)

    def raw_body(self) -> bytes:
        if self._received > self.max_body_bytes:
            raise ApiError(413, f"the request body is {self._received} bytes, more than the "
                                f"{self.max_body_bytes} this route takes", {"limit_bytes": self.max_body_bytes})
        return b"".join(self._chunks or ())

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        if status_code == 403 and getattr(self, "_jupyter_current_user", None) is None and not self.public:
            status_code, exc = 401, self._unauthorized()
            self.set_status(401)
        if status_code == 403 and getattr(self, "forkd_refusal", None):  # the authorizer's reason
            message = self.forkd_refusal
        elif isinstance(exc, ApiError):
            message = exc.message
        elif isinstance(exc, web.HTTPError):
            message = (exc.log_message % exc.args) if exc.log_message else (exc.reason or self._reason)
        else:
            message = internal_error(exc)
        if status_code == 405:  # RFC 9110: a 405 lists the methods the route has
            self.set_header("Allow", ", ".join(self.allowed_methods()))
        self.clear_header("Content-Type")
        self.finish(json.dumps({"error": message, **(exc.fields if isinstance(exc, ApiError) else {})}))

    @classmethod
    def allowed_methods(cls) -> list[str]:
        return [verb.upper() for verb in ("get", "post", "put", "patch", "delete")
                if getattr(cls, verb) is not getattr(web.RequestHandler, verb)]

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

    # --- running controller calls (admission.py) ---------------------------------------------------

    async def call(self, fn, *args, sandbox: str | None = None, **kwargs):
        """A control call (short: list, get, kill, ping...) on the control pool."""
        return await self._answer(self.app.admission.control(functools.partial(fn, *args, **kwargs)), sandbox)

    async def long_call(self, what: str, fn, *args, sandbox: str | None = None, lane: bool = False, **kwargs):
        """A long call (exec, branch, spawn...), admitted by the server's, the caller's and, with
        ``lane``, the sandbox's limits (user code runs one call at a time per sandbox)."""
        run = self.app.admission.long(functools.partial(fn, *args, **kwargs), caller=caller_of(self), what=what,
                                      sandbox=sandbox, lane=lane)
        return await self._answer(run, sandbox)

    async def _answer(self, call, sandbox: str | None):
        return await settled(self.app, call, sandbox)

    def body(self, spec: dict) -> dict:
        """Parse and type-check a JSON body, the way forkd's extractor does (before any other check)."""
        ctype = self.request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
            raise ApiError(415, "expected request with `Content-Type: application/json`")
        raw = self.raw_body().strip()
        if not raw:
            raise ApiError(400, "invalid JSON body: the body is empty (send {} when every field is optional)")
        try:  # orjson: NaN and Infinity are not JSON, and nesting stops at 1024 levels (no RecursionError)
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(422, "the body must be a JSON object")
        for name, (kind, required, *bounds) in spec.items():
            if data.get(name) is None:
                if required:
                    raise ApiError(422, f"missing field `{name}`")
                data.pop(name, None)
            elif not _is(kind, data[name]):
                expected = 'an integer (MiB) or "host"' if kind == "mib" else kind
                raise ApiError(422, f"invalid type for field `{name}`: expected {expected}")
            elif not (kind == "mib" and data[name] == HOST_MEMORY):  # "host": the controller resolves it
                if kind in ("integer", "mib"):
                    data[name] = int(data[name])
                if bounds and (why := out_of_range(name, data[name], bounds[0])):
                    raise ApiError(400, why)
        return {k: v for k, v in data.items() if k in spec}


class NotFoundHandler(ForkdHandler):
    """Unknown paths under v1/: 401 without a token (forkd authenticates before routing), else 404."""

    def _missing(self, *args) -> None:
        self.set_status(404)
        self.finish()

    get = post = put = delete = web.authenticated(_missing)
