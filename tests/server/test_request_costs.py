"""What a request no longer pays for, and what it still gets: the Host check's yes remembered (a no
still refused, every time), and ``forkd serve``'s access line made only where a handler writes it
(the request's metric recorded every time)."""

from __future__ import annotations

import io
import logging

from jupyter_server.prometheus.log_functions import prometheus_log_method
from prometheus_client import REGISTRY

from forkd_server.access_log import access_log, request_timer, written

from .test_api import call


async def test_a_host_the_check_refused_is_refused_again_after_one_it_let_in(jp_fetch, forkd_app):
    for host in ("localhost", "evil.example", "127.0.0.1", "evil.example", "localhost"):
        code, body = await call(jp_fetch, "GET", "sandboxes", headers={"Host": host})
        assert (code == 200) == (host != "evil.example"), (host, code, body)


class _Request:
    method = "POST"

    def request_time(self) -> float:
        return 0.001


class _Handler:
    request = _Request()

    def __init__(self, log: logging.Logger, status: int):
        self.log, self.status = log, status

    def get_status(self) -> int:
        return self.status


def _count(status: int) -> float:
    labels = {"method": "POST", "handler": f"{__name__}._Handler", "status_code": str(status)}
    return REGISTRY.get_sample_value("http_request_duration_seconds_count", labels) or 0


def test_the_access_line_is_made_only_where_a_handler_takes_it_and_the_metric_always():
    logger = logging.getLogger("forkd.test.access")
    logger.setLevel(logging.DEBUG)  # as traitlets leaves an app's logger: its handler filters
    logger.propagate = False
    console = logging.StreamHandler(io.StringIO())
    console.setLevel(logging.WARNING)
    logger.addHandler(console)
    made = []
    log = access_log(made.append, record_metrics=True)
    try:
        before = _count(200)
        log(_Handler(logger, 200))  # a 2xx is a debug line: nobody takes it
        assert made == [] and _count(200) == before + 1
        failed = _Handler(logger, 404)
        log(failed)  # a warning: written (jupyter_server's log_request records its metric too)
        assert made == [failed]
        console.setLevel(logging.DEBUG)  # --debug
        ok = _Handler(logger, 200)
        log(ok)
        assert made == [failed, ok]
    finally:
        logger.removeHandler(console)
    # no handler anywhere on its way up: Python's last resort writes warnings and above
    assert not written(logger, logging.DEBUG) and written(logger, logging.WARNING)
    logger.propagate = True  # up to the root, whose handlers (pytest's own here) take what they take
    assert written(logger, logging.ERROR)


def test_the_request_metric_is_jupyter_servers_series_each_found_once():
    observe = request_timer()
    before = {status: _count(status) for status in (200, 201)}
    for _ in range(3):
        observe(_Handler(None, 200))  # the series found the first time, kept for the next
    observe(_Handler(None, 201))  # another status: a series of its own
    prometheus_log_method(_Handler(None, 200))  # jupyter_server's own way: the same series
    assert _count(200) == before[200] + 4 and _count(201) == before[201] + 1
