"""``forkd serve``'s access log: jupyter_server's, its line made only where a handler will write it.

jupyter_server formats a line for every request and logs a 2xx at debug level, and traitlets
leaves the server's logger at DEBUG (its console handler filters), so each ping built and threw
away a log record: ~4% of the server's CPU per ping. Here the line is made only when some handler
on the logger's way up would take its level (``--debug``, or a ``logging_config`` that adds one);
the request's Prometheus metric is recorded every time, as before, in jupyter_server's histogram
with its labels; the labelled series is looked up once per route, method and status (prometheus
``labels()`` checks the names and builds the key on every call: ~1% of a ping's CPU).
"""

from __future__ import annotations

import logging
from typing import Callable

from jupyter_server.prometheus.metrics import HTTP_REQUEST_DURATION_SECONDS
from tornado.log import access_log as tornado_access_log

SERIES_KEPT = 1024  # labelled series remembered (routes x methods x statuses; past it, looked up each time)


def level_of(status: int) -> int:
    """The level jupyter_server logs an answer of ``status`` at."""
    if status < 300 or status == 304:
        return logging.DEBUG
    return logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR


def written(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` on ``logger`` reaches a handler that takes it."""
    if not logger.isEnabledFor(level):
        return False
    found = False
    node: logging.Logger | None = logger
    while node is not None:
        for handler in node.handlers:
            found = True
            if level >= handler.level:
                return True
        node = node.parent if node.propagate else None
    return not found and logging.lastResort is not None and level >= logging.lastResort.level


def request_timer() -> Callable:
    """jupyter_server's ``prometheus_log_method``: the request's duration observed in
    ``http_request_duration_seconds`` by method, handler class and status, each series found once."""
    series: dict = {}

    def observe(handler) -> None:
        method, cls, status = handler.request.method, type(handler), handler.get_status()
        child = series.get((method, cls, status))
        if child is None:
            child = HTTP_REQUEST_DURATION_SECONDS.labels(method=method, handler=f"{cls.__module__}.{cls.__name__}",
                                                         status_code=status)
            if len(series) < SERIES_KEPT:
                series[(method, cls, status)] = child
        child.observe(handler.request.request_time())

    return observe


def access_log(log_request: Callable, record_metrics: bool) -> Callable:
    """tornado's ``log_function``: ``log_request`` (jupyter_server's) where its line is written,
    else only the metric (if ``record_metrics``)."""
    observe = request_timer()

    def log(handler) -> None:
        # a plain tornado handler (serve.py's OutsideTheApi) has no .log: tornado's access logger,
        # as jupyter_server's log_request falls back to (an error here would print the request's
        # URL, its ?token= included, in a traceback)
        logger = getattr(handler, "log", None) or tornado_access_log
        if written(logger, level_of(handler.get_status())):
            log_request(handler)
        elif record_metrics:
            observe(handler)

    return log
