"""Every route the server's OpenAPI document names is a route of ``forkd router`` too (a client of
the router must find the same ``/v1``), JupyterHub's sharing of a snapshot included (``forkd router
--hub``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tornado.web import RequestHandler

import forkd_server
from forkd_server.fleet.handlers import NotFoundHandler, route_table


def test_the_router_answers_every_route_of_the_openapi_document():
    spec = json.loads((Path(forkd_server.__file__).parent / "openapi.json").read_text())
    routes = [(re.compile(pattern + "$"), handler) for pattern, handler in route_table()]
    missing = []
    for path, operations in spec["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "x1", path)
        handler = next(h for rx, h in routes if rx.match(concrete))
        for method in set(operations) & {"get", "post", "put", "patch", "delete"}:
            unrouted = handler is NotFoundHandler or getattr(handler, method) is getattr(RequestHandler, method)
            if unrouted:
                missing.append(f"{method.upper()} {path}")
    assert not missing, f"routes the router does not pass on: {missing}"
