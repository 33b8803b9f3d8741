"""The client SDK's wire: where the server is, its errors, one request, the event stream.

``Connection`` finds the server (``base_url``, else ``$FORKD_URL``, else a running server found
from Jupyter's runtime files, else ``http://127.0.0.1:8889``) and its token, and turns each answer
into JSON or an error: ``ControllerError`` for a non-2xx answer, ``ServerUnreachable`` when nothing
answers, ``ServerTimeout`` when the server took the request but did not answer in time.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import socket
import urllib.error
import urllib.parse
import urllib.request
import warnings
from typing import Any

try:  # optional: parses a large listing several times faster; the standard library is enough
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _loads = json.loads

DEFAULT_URL = "http://127.0.0.1:8889"
CLIENT_HEADER = "X-Forkd-Client"


class ForkWarning(UserWarning):
    """A branch or a snapshot's setup asked for with ``lossy=True`` went ahead without what a
    fork() cannot carry (the process engine keeps one thread: other threads, child processes,
    pending asyncio tasks...). The snapshot keeps the list as ``warnings``; the VM engine carries
    all of it."""


def warn_lossy(info: dict, lead: str) -> None:
    """A ForkWarning when a lossy fork's reply lists what it did not carry (``warnings``)."""
    if info.get("warnings"):
        lost = "".join(f"\n  - {w}" for w in info["warnings"])
        warnings.warn(ForkWarning(f"{lead}:{lost}"), stacklevel=3)


class ControllerError(Exception):
    """A non-2xx answer. ``body`` is the parsed JSON (``{"error": ...}``), else the text, else ``{}``.

    The server's ``error`` says what happened in its first line and, when there is something to
    do, what in its second (``what``, ``hint``); the rest is in ``details`` (figures, the same fix
    in REST, SDK, CLI and magic words)."""

    def __init__(self, status: int, body: Any, url: str):
        self.status, self.body, self.url = status, body, url
        super().__init__(f"{status} from {url}: {self.message}")

    @property
    def message(self) -> str:
        if isinstance(self.body, dict) and "error" in self.body:
            return str(self.body["error"])
        return str(self.body) if self.body else "(empty body)"

    @property
    def what(self) -> str:
        """What happened: the first line of the message."""
        return self.message.partition("\n")[0]

    @property
    def hint(self) -> str:
        """What to do about it (the rest of the message), or ""."""
        return self.message.partition("\n")[2]

    @property
    def details(self) -> dict:
        """The facts behind the message (the body's ``details``), or {}."""
        details = self.body.get("details") if isinstance(self.body, dict) else None
        return dict(details) if isinstance(details, dict) else {}

    @property
    def lost(self) -> list[str]:
        """For a refused lossy fork (409): what it would have lost, one item each; else []."""
        return list(self.body.get("lost") or []) if isinstance(self.body, dict) else []


class ServerUnreachable(urllib.error.URLError):
    """No server answers at the URL (a ``URLError``, as forkd's SDK raises, with a helpful message:
    ``what``, ``hint`` and ``details`` as a ``ControllerError`` has them)."""

    def __init__(self, url: str, reason: Any):
        super().__init__(reason)
        self.url = url

    @property
    def what(self) -> str:
        return f"no forkd server answers at {self.url} ({self.reason})"

    @property
    def hint(self) -> str:
        return "start one with `forkd serve`, or point FORKD_URL (and FORKD_TOKEN) at a running one"

    @property
    def details(self) -> dict:
        return {"url": self.url, "reason": str(self.reason)}

    def __str__(self) -> str:
        return f"{self.what}\n{self.hint}"


class ServerTimeout(ServerUnreachable):
    """The server took the request but gave no answer in time (it is there, but busy or stuck)."""

    def __init__(self, url: str, reason: Any, timeout: float):
        super().__init__(url, reason)
        self.timeout = timeout

    @property
    def what(self) -> str:
        return f"the forkd server at {self.url} is up but gave no answer within {self.timeout:g} s"

    @property
    def hint(self) -> str:
        return "try again, or pass a longer timeout"

    @property
    def details(self) -> dict:
        return {"url": self.url, "timeout_s": self.timeout,
                "why": "the server is up, but what it waits on (a sandbox that does not answer, a long setup) "
                       "is taking longer"}

# --- finding a running server -------------------------------------------------------------------

def _runtime_dir() -> str:
    if os.environ.get("JUPYTER_RUNTIME_DIR"):
        return os.environ["JUPYTER_RUNTIME_DIR"]
    try:  # jupyter_core knows every platform's default; it is light and does not pull in the server
        from jupyter_core.paths import jupyter_runtime_dir
        return jupyter_runtime_dir()
    except ImportError:
        base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
        return os.path.join(base, "jupyter", "runtime")


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def _probe(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=timeout) as r:  # noqa: S310 - loopback URL
            return json.loads(r.read() or b"{}").get("ok") is True
    except (OSError, ValueError):
        return False


def discover_server() -> tuple[str, str | None] | None:
    """Find a running server with forkd: ``(url, token)`` or None.

    Reads Jupyter's runtime files (``jpserver-<pid>.json``; ``forkd serve`` writes one too). The
    server that started this kernel (``JPY_PARENT_PID``) comes first. Each candidate must answer
    ``/healthz`` under its forkd prefix: ``<url>forkd`` inside jupyter lab, ``<url>`` for ``forkd serve``.
    """
    infos = []
    for path in glob.glob(os.path.join(_runtime_dir(), "jpserver-*.json")):
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        if info.get("url") and _pid_alive(info.get("pid")):
            info["_mtime"] = os.path.getmtime(path)
            infos.append(info)
    parent = os.environ.get("JPY_PARENT_PID")
    infos.sort(key=lambda i: (str(i.get("pid")) != parent, -i["_mtime"]))
    for info in infos[:8]:
        root = info["url"].rstrip("/")
        for url in (root + "/forkd", root):
            if _probe(url):
                return url, info.get("token") or None
    return None



def label_query(labels: dict[str, str] | None) -> dict | None:
    """``{"k": "v", ...}`` as the repeatable ``?label=k=v`` filter (every pair must match)."""
    return {"label": [f"{k}={v}" for k, v in labels.items()]} if labels else None



class Connection:
    """Where the server is, its token, and one request to it (``_open``, ``_request``)."""

    def __init__(self, base_url: str | None = None, token: str | None = None, timeout: float = 60.0):
        url = base_url or os.environ.get("FORKD_URL")
        found_token = None
        if not url:
            found = discover_server()
            url, found_token = found if found else (DEFAULT_URL, None)
        self.base_url = url.rstrip("/")
        self.token = token if token is not None else (os.environ.get("FORKD_TOKEN") or found_token)
        self.timeout = timeout
        # Who this client is to the server's per-caller cap: clients sharing a token count apart.
        self.client_id = secrets.token_hex(8)

    def headers(self) -> dict[str, str]:
        """What every request of this client carries: its token and its client id."""
        headers = {CLIENT_HEADER: self.client_id}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    # -- transport --

    def _open(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
              content_type: str | None = None, timeout: float | None = None, query: dict | None = None):
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        headers = self.headers()
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            data = raw
            headers["Content-Type"] = content_type or "application/octet-stream"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        timeout = timeout or self.timeout
        try:
            return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310
        except urllib.error.HTTPError as exc:
            text = exc.read()
            try:
                parsed = json.loads(text) if text else {}
            except ValueError:
                parsed = text.decode("utf-8", "replace")
            raise ControllerError(exc.code, parsed, url) from None
        except urllib.error.URLError as exc:  # no connection (urllib wraps what happens up to the request)
            raise ServerUnreachable(self.base_url, exc.reason) from None
        except TimeoutError as exc:  # connected and asked, but no answer in time
            raise ServerTimeout(self.base_url, exc, timeout) from None
        except ConnectionError as exc:
            raise ServerUnreachable(self.base_url, exc) from None

    def _request(self, method: str, path: str, body: Any = None, **kw) -> Any:
        with self._open(method, path, body, **kw) as resp:
            text = resp.read()
        return _loads(text) if text else None


class EventStream:
    """An open ``/v1/events`` subscription: an iterator of event dicts; ``close()`` ends it."""

    def __init__(self, resp):
        self._resp = resp
        self._lines = iter(resp)
        self.closed = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> dict:
        data: list[str] = []
        try:
            for raw in self._lines:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line:
                    if data:
                        return json.loads("\n".join(data))
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())
        except Exception:
            if not self.closed:  # a read cut short by close() is the end of the stream, not an error
                raise
        self.close()
        raise StopIteration

    def close(self) -> None:
        """End the subscription; a thread blocked reading it sees the end of the stream."""
        if self.closed:
            return
        self.closed = True
        sock = getattr(getattr(getattr(self._resp, "fp", None), "raw", None), "_sock", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks a reader in another thread
        except OSError:
            pass
        self._resp.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

