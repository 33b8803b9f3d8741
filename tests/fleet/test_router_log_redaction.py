"""``forkd router`` writes no token to its log: each of its routes (every route of openapi.json, the
router's own and an unknown one) is called with ``?token=`` (a wrong one, then the router's own),
and every line the router logs for it shows ``[secret]``. The router logs a request when it fails
(4xx, 5xx), so the ids are ones no host has; the hosts' token never appears either, nor does either
token when a host goes away under a pinned call or a session (the proxy's upstream errors)."""

from __future__ import annotations

import itertools
import json
import re
import secrets
import time

import pytest

from forkd_server.client import Controller
from forkd_server.fleet.handlers import route_table
from forkd_server.handlers import OPENAPI_PATH

from ..serving import status_of
from .fleet import fleet

with open(OPENAPI_PATH) as _f:
    _PATHS = json.load(_f)["paths"]
ROUTES = [(method.upper(), path) for path, item in _PATHS.items()
          for method in item if method in ("get", "post", "put", "patch", "delete")]
ROUTES += [("GET", "/v1/fleet/hosts"), ("POST", "/v1/fleet/register"), ("GET", "/v1/no-such-route")]
_probes = itertools.count()


@pytest.fixture(scope="module")
def router():
    with fleet(1) as (router, hosts):
        router.hosts_token = hosts[0].token
        yield router


def _concrete(path: str) -> str:
    return path.format(id="sb-none", tag="none", name="none", ref="none")


def _lines_of(router, marker: str, timeout: float = 10) -> list[str]:
    """The log lines of the request marked ``marker`` (the access line is written when it ends)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in router.output().splitlines() if marker in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def _assert_clean(router, *tokens: str) -> None:
    out = router.output()
    for token in (*tokens, router.token, router.hosts_token):
        assert token not in out, f"a token in the router's log:\n{out}"


def test_every_route_of_the_router_is_probed():
    probes = [_concrete(p) for _, p in ROUTES]
    for pattern, handler in route_table():
        assert any(re.fullmatch(pattern, p) for p in probes), f"no probe for {pattern} ({handler.__name__})"


@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_a_token_in_the_query_is_logged_as_secret(router, method, path):
    wrong = "wrong-" + secrets.token_hex(12)
    for token in (wrong, router.token):
        if path == "/v1/events" and token == router.token:
            continue  # a stream: it ends (and would be logged) only when the client goes
        marker = f"probe{next(_probes)}x"
        status = status_of(f"{router.url}{_concrete(path)}?{marker}=1&token={token}", method)
        if status >= 400:  # what the router logs
            lines = _lines_of(router, marker)
            assert lines, f"nothing logged for {method} {path} ({status})"
            for line in lines:
                assert f"{marker}=1&token=[secret]" in line, line
        _assert_clean(router, wrong)


def test_no_token_in_the_log_when_a_host_goes_away_under_astatus_of():
    """The proxy's upstream errors (a pinned call, a session) and the router's notes on a host that
    went down name neither the router's token nor the hosts'."""
    with fleet(1) as (router, hosts):
        router.hosts_token = hosts[0].token
        host = Controller(hosts[0].url, hosts[0].token)
        host.create_snapshot("redact", setup="x = 1")
        kid = Controller(router.url, router.token).spawn_sandboxes("redact")[0]["id"]
        hosts[0].crash()  # kill -9: the sandbox's host stops answering
        try:
            for path in (f"/v1/sandboxes/{kid}/ping", f"/v1/sandboxes/{kid}/session", f"/v1/sandboxes/{kid}"):
                for token in ("wrong-" + secrets.token_hex(12), router.token):
                    marker = f"probe{next(_probes)}x"
                    status = status_of(f"{router.url}{path}?{marker}=1&token={token}", "GET")
                    assert status >= 400, (path, status)
                    for line in _lines_of(router, marker):
                        assert f"{marker}=1&token=[secret]" in line, line
            router.wait(lambda h: h["hosts_up"] == 0, "mark the host down")
            _assert_clean(router)
        finally:
            hosts[0].start()
            hosts[0].wait_healthy()
            hosts[0].wait_settled()
