"""No route writes a token to the log: each route of openapi.json is called with ``?token=`` (a wrong
one, then the server's own), and every line the server logs for that request shows ``[secret]``."""

from __future__ import annotations

import itertools
import json
import re
import secrets
import time

import pytest

from forkd_server.handlers import OPENAPI_PATH

from ..serving import serving, status_of

with open(OPENAPI_PATH) as _f:
    _PATHS = json.load(_f)["paths"]
ROUTES = [(method.upper(), path) for path, item in _PATHS.items()
          for method in item if method in ("get", "post", "put", "patch", "delete")]
_probes = itertools.count()
_ACCESS = re.compile(r"\) \d+\.\d\dms")  # jupyter_server's access line ends with the time taken


@pytest.fixture(scope="module")
def server():
    # DEBUG: a request that succeeds is logged too (jupyter_server logs a 2xx at debug level, in the
    # log of the handler's extension)
    with serving("--ForkdApp.log_level=DEBUG") as srv:
        yield srv


def _lines_of(server, marker: str, timeout: float = 10) -> list[str]:
    """The log lines of the request marked ``marker``, once the access line (written when the request
    ends) is there."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in server.output().splitlines() if marker in line]
        if any(_ACCESS.search(line) for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_every_route_is_covered():
    assert ("GET", "/v1/sandboxes/{id}/session") in ROUTES and len(ROUTES) > 30


@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_a_token_in_the_query_is_logged_as_secret(server, method, path):
    wrong = "wrong-" + secrets.token_hex(12)
    for token in (wrong, server.token):
        if path == "/v1/events" and token == server.token:
            continue  # a stream: it is logged when it ends, which this client does not wait for
        marker = f"probe{next(_probes)}x"
        route = path.format(id="sb-none", tag="none", name="none", ref="none")
        status_of(f"{server.url}{route}?{marker}=1&token={token}", method)
        lines = _lines_of(server, marker)
        assert lines, f"nothing logged for {method} {route}"
        for line in lines:
            assert f"{marker}=1&token=[secret]" in line, line
        assert token not in server.output()
