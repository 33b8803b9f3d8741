"""Request URIs fit for a log, for every tornado handler forkd has (``forkd serve``'s routes and
``forkd router``'s alike): the values of ``?token=`` and ``?_xsrf=`` replaced by ``[secret]``.
Needs tornado only, so the router uses it without jupyter-server's handlers."""

from __future__ import annotations

import re

from tornado import web
from tornado.log import app_log, gen_log

_SECRET_PARAM = re.compile(r"(?i)([?&](?:token|_xsrf)=)[^&#]*")


def scrub(uri: str) -> str:
    """A request URI fit for a log: the values of ``?token=`` and ``?_xsrf=`` replaced."""
    return _SECRET_PARAM.sub(r"\1[secret]", uri)


class ScrubbedLog:
    """The one way a forkd handler (REST and WebSocket alike) puts a request in the log: its URI
    with ``?token=`` scrubbed. tornado's own ``_request_summary`` (its access log) and
    ``log_exception`` write the URI in clear with every 4xx. Put it first among the bases."""

    def _request_summary(self) -> str:
        return f"{self.request.method} {scrub(self.request.uri)} ({self.request.remote_ip})"

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, web.HTTPError):
            if value.log_message:
                gen_log.warning("%d %s: %s", value.status_code, self._request_summary(),
                                value.log_message % value.args)
        else:
            app_log.error("Uncaught exception %s", self._request_summary(), exc_info=(typ, value, tb))
