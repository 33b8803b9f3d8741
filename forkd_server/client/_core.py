"""The SDK's sans-I/O core: every decision the sync and the async SDK share, and no socket or loop.

- ``Wire``: where the server is and its token; builds each ``Request`` (``request``), turns an
  answer into JSON or a ``ControllerError`` (``answer``), and decides what a failed exchange
  becomes: one more try, or which error (``failure``).
- Effects: what a multi-step operation, written once as a generator, asks its driver to do. It
  yields a ``Request`` (and gets the parsed answer back), ``Sleep``, ``Subscribe``/``NextEvent``
  (the event stream), ``OpenSession``/``Send``/``Recv``/``Close`` (a streaming session), ``Wait``
  (an awaitable a callback returned) or ``Emit`` (a value for the caller of a streaming call).
  ``_sync`` and ``_async`` each hold a driver that performs them; ``Plan`` composes them.
- ``SSEDecoder``: ``/v1/events``' server-sent events, line by line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import secrets
import sys
import time
from typing import Any, Callable, Iterator, NamedTuple
from urllib.parse import urlencode, urlsplit

from ._discovery import discover_server
from ._errors import BadServerURL, ControllerError, ServerTimeout, ServerUnreachable

try:  # optional: parses a large listing several times faster; the standard library is enough
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _loads = json.loads

DEFAULT_URL = "http://127.0.0.1:8889"
# The headers forkd's own SDK sends (reference/forkd-api.md §8), so a server sees the same client
USER_AGENT = "Python-urllib/%d.%d" % sys.version_info[:2]
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
CLIENT_HEADER = "X-Forkd-Client"
MISSING_HEADER = "X-Forkd-Hosts-Missing"  # a fleet router's: hosts whose part of a merged list is missing
RECOVERING_POLL = 0.1  # s between asks about an object a restarted server has not settled yet
# s for a new connection: the TCP connect and, over https, the TLS handshake. A server answers both
# at once; past this nothing is going to (an https URL of a plain-http server waits for ever).
CONNECT_TIMEOUT = 15.0


class Partial(list):
    """A list a fleet's router merged without some hosts' parts: ``missing_hosts`` maps the URL of
    each host that did not answer in time (or answered what is not a list) to why. What such a host
    holds is not in the list, and is not gone either."""

    def __init__(self, items, missing_hosts: dict[str, str]):
        super().__init__(items)
        self.missing_hosts = missing_hosts


def unanswered(*listings) -> dict[str, str]:
    """The hosts missing from any of ``listings`` ({url: why}; empty for lists not from a router,
    or that a router merged whole)."""
    out: dict[str, str] = {}
    for listing in listings:
        out.update(getattr(listing, "missing_hosts", {}))
    return out


def missing_hosts(header: str | None) -> dict[str, str]:
    """The router's ``X-Forkd-Hosts-Missing`` (``url: why; url: why``) as {url: why}."""
    out: dict[str, str] = {}
    last = None
    for part in (header or "").split("; "):
        url, sep, why = part.partition(": ")
        if sep and url.startswith(("http://", "https://")) and " " not in url:
            out[last := url] = why
        elif last is not None:
            out[last] += "; " + part  # a reason with "; " of its own
    return out


class Request:
    """One HTTP exchange to make: ``target`` (path and query) is what goes on the wire; ``url`` is
    the whole address, for errors. ``idempotent``: safe to send again if the connection dropped."""

    __slots__ = ("method", "url", "target", "headers", "content", "timeout", "idempotent", "text")

    def __init__(self, method: str, url: str, target: str, headers: dict, content: bytes | None,
                 timeout: float, idempotent: bool, text: bool = False):
        self.method, self.url, self.target, self.headers = method, url, target, headers
        self.content, self.timeout, self.idempotent, self.text = content, timeout, idempotent, text

    def __repr__(self) -> str:
        return f"Request({self.method} {self.url})"


# --- effects ------------------------------------------------------------------------------------

class Sleep(NamedTuple):
    seconds: float


class Subscribe(NamedTuple):
    """Open ``/v1/events`` (the request); the driver returns the stream."""
    request: Request


class NextEvent(NamedTuple):
    """The stream's next event (a dict), None once it ended; TimeoutError after its timeout."""
    stream: Any


class OpenSession(NamedTuple):
    """A streaming session with a sandbox; the driver returns it."""
    sandbox_id: str
    shell: str = "plain"
    timeout: float = 120.0


class Send(NamedTuple):
    session: Any
    message: dict


class Recv(NamedTuple):
    """The session's next message, None once it ended; TimeoutError after ``timeout``."""
    session: Any
    timeout: float | None = None


class Close(NamedTuple):
    """Close a stream or a session (never raises)."""
    what: Any


class Wait(NamedTuple):
    """Await what a callback returned (the async SDK takes ``async def`` callbacks)."""
    awaitable: Any


class Emit(NamedTuple):
    """A value for the caller of a streaming operation (``for event in sb.run_stream(...)``)."""
    value: Any


class LeftEarly(BaseException):
    """Raised inside a streaming operation whose caller closed it early (left its loop). Not
    GeneratorExit: ``yield from`` would close the inner generators instead of letting them clean up."""


def notify(callback: Callable | None, *args) -> Iterator:
    """Call a callback from an operation: a plain one, one returning an awaitable, or a generator
    of effects (the SDK's own layers)."""
    if callback is None:
        return None
    result = callback(*args)
    if inspect.isgenerator(result):
        return (yield from result)
    if inspect.isawaitable(result):
        return (yield Wait(result))
    return result


def consume(operation: Iterator, handle: Callable) -> Iterator:
    """Run a streaming operation inside another: its effects pass through, each value it emits goes
    to ``handle`` (see ``notify``), and what a handler raises goes back into it (so it can stop the
    cell it runs). Returns the operation's return value."""
    value = error = None
    while True:
        try:
            effect = operation.throw(error) if error is not None else operation.send(value)
        except StopIteration as stop:
            return stop.value
        value = error = None
        try:
            if isinstance(effect, Emit):
                yield from notify(handle, effect.value)
            else:
                value = yield effect
        except BaseException as exc:  # noqa: BLE001 - handed back to the operation, which re-raises it
            error = exc


# --- the wire -----------------------------------------------------------------------------------

def label_query(labels: dict[str, str] | None) -> dict | None:
    """``{"k": "v", ...}`` as the repeatable ``?label=k=v`` filter (every pair must match)."""
    return {"label": [f"{k}={v}" for k, v in labels.items()]} if labels else None


HOST_MEMORY = "host"  # memory_limit_mib: all the memory of the host that takes the call, resolved there


def memory_limit_arg(text: str) -> int | str:
    """A command line's ``--memory-limit-mib``: whole MiB, or ``host`` (all the memory of the host
    the sandbox lands on). An argparse ``type``: its error names what was given."""
    text = text.strip()
    if text == HOST_MEMORY:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'{text!r} is neither a whole number of MiB nor "host"') from None


def check_url(url: str) -> str:
    """``url`` if it names a server (http or https, a host, a numeric port), else a ValueError saying
    how to write one: ``127.0.0.1:8889`` alone would otherwise fail deep in the HTTP client."""
    split = urlsplit(url)
    try:
        split.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        split = None
    if split is None or split.scheme not in ("http", "https") or not split.hostname:
        raise BadServerURL(f"not a forkd server's URL: {url!r}; give its scheme, host and port, e.g. "
                         f"http://127.0.0.1:8889 (in --url, $FORKD_URL or base_url)")
    return url


class Wire:
    """Where the server is (``base_url``, else ``$FORKD_URL``, else a running server found from
    Jupyter's runtime files, else ``http://127.0.0.1:8889``), its token (``token``, else
    ``$FORKD_TOKEN``, else the found server's), and what goes over the wire to it.

    ``max_connections``: connections kept open to the server (the pool's size); ``retries``: how
    many times a request that is safe to repeat is sent again when a kept connection dropped."""

    def __init__(self, base_url: str | None = None, token: str | None = None, timeout: float = 60.0, *,
                 max_connections: int = 16, retries: int = 1):
        url = base_url or os.environ.get("FORKD_URL")
        found_token = None
        if not url:
            found = discover_server()
            url, found_token = found if found else (DEFAULT_URL, None)
        self.base_url = check_url(url).rstrip("/")
        self.token = token if token is not None else (os.environ.get("FORKD_TOKEN") or found_token)
        self.timeout = timeout
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.max_connections, self.retries = max_connections, retries
        split = urlsplit(self.base_url)
        self._prefix = split.path  # plain concatenation, as forkd's SDK: FORKD_URL may carry a path
        # Who this client is to the server's per-caller cap: clients sharing a token count apart.
        self.client_id = secrets.token_hex(8)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def headers(self) -> dict[str, str]:
        """What every request of this client carries: its token and its client id."""
        headers = {CLIENT_HEADER: self.client_id}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                content_type: str | None = None, timeout: float | None = None, query: dict | None = None,
                idempotent: bool | None = None, text: bool = False) -> Request:
        """A request to ``path`` under the base URL: a JSON ``body``, or ``raw`` bytes. ``text``:
        the answer is text (``/metrics``), not JSON."""
        target = self._prefix + path
        if query:
            target += "?" + urlencode(query, doseq=True)
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **self.headers()}
        content = None
        if body is not None:
            content = json.dumps(body).encode()  # forkd's separators (", " and ": ")
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            content = raw
            headers["Content-Type"] = content_type or "application/octet-stream"
        url = self.base_url[:len(self.base_url) - len(self._prefix)] + target
        return Request(method, url, target, headers, content, timeout or self.timeout,
                       method in IDEMPOTENT if idempotent is None else idempotent, text)

    @staticmethod
    def answer(request: Request, status: int, content: bytes, missing: str | None = None) -> Any:
        """The parsed JSON of a 2xx answer (None if empty), a ``Partial`` list where a router says
        hosts are missing from it (``missing``: its header); a ``ControllerError`` for any other."""
        if 200 <= status < 300:
            if request.text:
                return content.decode()
            parsed = _loads(content) if content else None
            if missing and isinstance(parsed, list):
                return Partial(parsed, missing_hosts(missing))
            return parsed
        try:
            parsed = json.loads(content) if content else {}
        except ValueError:
            parsed = content.decode("utf-8", "replace")
        raise ControllerError(status, parsed, request.url)

    @staticmethod
    def ask_again(request: Request, status: int, content: bytes, started: float) -> float | None:
        """Seconds to wait before sending ``request`` again, else None. A 503 ``recovering`` (a
        restarted server has not settled the object yet, and did nothing) is asked again, within the
        request's timeout (``started``: ``time.monotonic()`` when it was first sent)."""
        if status != 503 or b"recovering" not in content:
            return None
        try:
            body = json.loads(content)
        except ValueError:
            return None
        if not (isinstance(body, dict) and body.get("recovering") is True):
            return None
        if time.monotonic() - started + RECOVERING_POLL > request.timeout:
            return None
        return RECOVERING_POLL

    def failure(self, request: Request, kind: str, reason: Any, attempt: int) -> Exception | None:
        """What a failed exchange becomes: None to send it again, else the error to raise.

        ``kind``: ``connect`` (nothing was sent: no server), ``timeout`` (sent, no answer in time),
        ``dropped`` (the connection closed before an answer: a kept connection the server had
        closed, or a server that went away)."""
        if kind == "timeout":
            return ServerTimeout(self.base_url, reason, request.timeout)
        if kind == "dropped" and request.idempotent and attempt < self.retries:
            return None
        return ServerUnreachable(self.base_url, reason)

    @property
    def plan(self) -> "Plan":
        """The same calls as steps of a bigger operation: ``x = yield from ctl.plan.get_sandbox(id)``.
        (Made afresh each time: kept, it would tie the controller in a cycle, and its pool with it.)"""
        return Plan(self)


class Plan:
    """A controller's calls, not run but returned as generators of effects, so that an operation
    written once (``Sandbox.eval``, ``wait_snapshot``...) can make them one after another:
    ``info = yield from controller.plan.get_sandbox(id)``. The calls are the controller's own
    (looked up on its class); only ``_do`` differs: it returns the steps instead of running them."""

    def __init__(self, controller: Wire):
        self._controller = controller

    def __getattr__(self, name: str):
        attr = getattr(type(self._controller), name, None)
        if inspect.isfunction(attr):
            return attr.__get__(self)
        return getattr(self._controller, name)

    @staticmethod
    def _do(step, then: Callable | None = None):
        result = (yield step) if isinstance(step, Request) else (yield from step)
        return then(result) if then is not None else result


# --- the event stream ---------------------------------------------------------------------------

class SSEDecoder:
    """Server-sent events from their lines: ``line()`` returns an event's JSON once it is complete."""

    def __init__(self):
        self._data: list[str] = []

    def line(self, raw: bytes | str) -> dict | None:
        line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).rstrip("\r\n")
        if not line:
            if self._data:
                data, self._data = "\n".join(self._data), []
                return json.loads(data)
        elif line.startswith("data:"):
            self._data.append(line[5:].lstrip())
        return None
