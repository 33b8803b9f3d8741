"""What the client SDK raises and warns: ``ControllerError`` for a non-2xx answer,
``ServerUnreachable`` when nothing answers, ``ServerTimeout`` when the server took the request but
did not answer in time, ``ForkWarning`` for a lossy fork. The sync and async SDKs raise the same ones.
"""

from __future__ import annotations

import urllib.error
import warnings
from typing import Any
from urllib.parse import urlsplit


class ForkWarning(UserWarning):
    """A branch or a snapshot's setup asked for with ``lossy=True`` went ahead without what a
    fork() cannot carry (the process engine keeps one thread: other threads, child processes,
    pending asyncio tasks...). The snapshot keeps the list as ``warnings``; the VM engine carries
    all of it."""


def warn_lossy(info: dict, lead: str) -> dict:
    """A ForkWarning when a lossy fork's reply lists what it did not carry (``warnings``); ``info``."""
    if info.get("warnings"):
        lost = "".join(f"\n  - {w}" for w in info["warnings"])
        warnings.warn(ForkWarning(f"{lead}:{lost}"), stacklevel=4)
    return info


URL_HINT = ("point FORKD_URL (--url, base_url) at the server's base URL, without /v1: http://HOST:8889 for forkd "
            "serve, http://HOST:8888/forkd inside Jupyter")


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
        path = urlsplit(self.url).path
        page = isinstance(self.body, str) and self.body.lstrip()[:9].lower() in ("<!doctype", "<html>")
        if self.status == 404 and (not self.body or page):  # forkd's (empty) or Jupyter's (a page): no such route
            return f"{path} is not a route of this server\n{URL_HINT}"
        if page:  # a web server, not forkd's API: the page itself says nothing to a client (and may hold a token)
            return f"the server answered {path} with a web page ({self.status}), not forkd's JSON\n{URL_HINT}"
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

    def about_field(self, name: str) -> str | None:
        """What a 400/422 says of the request's field ``name`` ("must be at least 1 and at most
        1000, got 5000"), for a front end to say it of its own option; else None."""
        prefix = f"field `{name}` "
        if self.status in (400, 422) and self.what.startswith(prefix):
            return self.what.removeprefix(prefix)
        return None

    @property
    def lost(self) -> list[str]:
        """For a refused lossy fork (409): what it would have lost, one item each; else []."""
        return list(self.body.get("lost") or []) if isinstance(self.body, dict) else []


class BadServerURL(ValueError):
    """The server's URL (``base_url``, ``$FORKD_URL``, ``--url``) cannot name a server: no scheme,
    no host, a port that is not a number."""


class ServerUnreachable(urllib.error.URLError):
    """No server answers at the URL (a ``URLError``, as forkd's SDK raises, with a helpful message:
    ``what``, ``hint`` and ``details`` as a ``ControllerError`` has them)."""

    def __init__(self, url: str, reason: Any):
        super().__init__(reason)
        self.url = url

    @property
    def what(self) -> str:
        if "CERTIFICATE_VERIFY_FAILED" in str(self.reason):
            return f"the server at {self.url} has a certificate this host does not trust ({self.reason})"
        return f"no forkd server answers at {self.url} ({self.reason})"

    @property
    def hint(self) -> str:
        why, scheme = str(self.reason), urlsplit(self.url).scheme
        if "CERTIFICATE_VERIFY_FAILED" in why:  # a server answered, with a certificate this host does not trust
            return ("set SSL_CERT_FILE to the CA certificate that signed the server's (for forkd serve --tls-cert "
                    "with a self-signed one, that certificate file)")
        if scheme == "https" and ("handshake" in why or "WRONG_VERSION_NUMBER" in why or "record layer" in why):
            return f"the server may speak plain http: try {self._with_scheme('http')}"
        if scheme == "http" and ("reset by peer" in why or "closed connection without response" in why
                                 or "not an HTTP answer" in why):
            return (f"start one with `forkd serve`; if the server serves TLS (forkd serve --tls-cert), use "
                    f"{self._with_scheme('https')}")
        return "start one with `forkd serve`, or point FORKD_URL (and FORKD_TOKEN) at a running one"

    def _with_scheme(self, scheme: str) -> str:
        return scheme + self.url[self.url.index(":"):]

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


class SessionClosed(ConnectionError):
    """The session ended: the sandbox was killed, exited, or the server went away."""
