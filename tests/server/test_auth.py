"""Auth rules: every forkd route except /healthz answers 401 with forkd's bodies without a token."""

from __future__ import annotations

import json
import re

import pytest

from forkd_server.handlers import HealthHandler, route_table
from forkd_server.mcp.http import routes as mcp_routes

VERBS = ("get", "post", "put", "patch", "delete")


def _routes():
    """(method, path parts) for every verb every handler implements, with sample path arguments."""
    out = []
    for pattern, handler in route_table("forkd/") + mcp_routes("forkd/"):
        path = pattern.lstrip("/").replace(r"\.", ".").replace("([^/]+)", "x").replace(".*", "nope").replace("/?", "")
        for verb in VERBS:
            if verb in vars(handler) or any(verb in vars(base) for base in handler.__mro__[1:]
                                            if base.__module__ == "forkd_server.handlers"):
                out.append((verb.upper(), path, handler))
    return out


ROUTES = _routes()


def test_route_enumeration_covers_the_app(forkd_app):
    registered = [(p, h) for p, h in forkd_app.handlers]
    assert registered == route_table("forkd/") + mcp_routes("forkd/")
    assert len(ROUTES) >= 34  # every verb of every route (workspaces and compact included)


def test_each_route_is_the_first_to_match_its_paths():
    """The table's order is free (the calls made most come first) but for the routes whose paths
    another route's pattern also matches: each path reaches its own route."""
    table = route_table("forkd/") + mcp_routes("forkd/")
    for _method, path, handler in ROUTES:
        first = next(h for pattern, h in table if re.fullmatch(pattern, "/" + path))
        assert first is handler, (path, first, handler)
    assert route_table("forkd/")[-1][0] == "/forkd/v1/.*"


@pytest.mark.parametrize("method,path,handler", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
async def test_no_token_is_401(jp_fetch, forkd_app, method, path, handler):
    body = "{}" if method in ("POST", "PUT", "PATCH") else None
    headers = {"Authorization": "", "Content-Type": "application/json"}
    r = await jp_fetch(*path.split("/"), method=method, body=body, headers=headers, raise_error=False,
                       allow_nonstandard_methods=True)
    if handler is HealthHandler:
        assert (r.code, json.loads(r.body)) == (200, {"ok": True})
        return
    assert r.code == 401, (method, path, r.code, r.body)
    assert json.loads(r.body) == {"error": "missing bearer token"}
    assert r.headers["Content-Type"].startswith("application/json")


@pytest.mark.parametrize("method,path,handler", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
async def test_wrong_token_is_401(jp_fetch, forkd_app, method, path, handler):
    if handler is HealthHandler:
        pytest.skip("/healthz is public")
    body = "{}" if method in ("POST", "PUT", "PATCH") else None
    headers = {"Authorization": "Bearer not-the-token", "Content-Type": "application/json"}
    r = await jp_fetch(*path.split("/"), method=method, body=body, headers=headers, raise_error=False,
                       allow_nonstandard_methods=True)
    assert r.code == 401, (method, path, r.code, r.body)
    assert json.loads(r.body) == {"error": "invalid bearer token"}


async def test_wrong_token_in_query_is_invalid_not_missing(jp_fetch, forkd_app):
    r = await jp_fetch("forkd", "v1", "sandboxes", params={"token": "nope"}, headers={"Authorization": ""},
                       raise_error=False)
    assert (r.code, json.loads(r.body)) == (401, {"error": "invalid bearer token"})


async def test_bearer_header_is_accepted(jp_fetch, forkd_app, jp_auth_header):
    token = jp_auth_header["Authorization"].split()[1]
    r = await jp_fetch("forkd", "v1", "sandboxes", headers={"Authorization": f"Bearer {token}"})
    assert r.code == 200 and json.loads(r.body) == []


async def test_a_token_in_the_header_gets_no_login_cookie(jp_fetch, forkd_app, jp_auth_header):
    """It comes with every call: a cookie would only be signed, kept and sent back for nothing. A
    login by ``?token=`` (a browser's link) still gets one, and the cookie alone lets it in after."""
    token = jp_auth_header["Authorization"].split()[1]
    for scheme in ("token", "Bearer"):
        r = await jp_fetch("forkd", "v1", "sandboxes", headers={"Authorization": f"{scheme} {token}"})
        assert r.code == 200 and "Set-Cookie" not in r.headers, r.headers
    r = await jp_fetch("forkd", "v1", "sandboxes", params={"token": token}, headers={"Authorization": ""})
    cookie = r.headers["Set-Cookie"].split(";", 1)[0]
    assert r.code == 200 and cookie.startswith("username-"), r.headers
    r = await jp_fetch("forkd", "v1", "sandboxes", headers={"Authorization": "", "Cookie": cookie})
    assert (r.code, json.loads(r.body)) == (200, [])


async def test_healthz_with_trailing_slash_is_public(jp_fetch, forkd_app):
    r = await jp_fetch("forkd", "healthz/", headers={"Authorization": ""})
    assert (r.code, json.loads(r.body)) == (200, {"ok": True})


async def test_unknown_path_needs_token_then_404(jp_fetch, forkd_app):
    r = await jp_fetch("forkd", "v1", "nothing", "here", headers={"Authorization": ""}, raise_error=False)
    assert r.code == 401
    r = await jp_fetch("forkd", "v1", "nothing", "here", raise_error=False)
    assert (r.code, r.body) == (404, b"")


async def test_wrong_method_is_405_with_error_body(jp_fetch, forkd_app):
    r = await jp_fetch("forkd", "v1", "snapshots", method="PUT", body="{}", raise_error=False)
    assert r.code == 405
    assert set(json.loads(r.body)) == {"error"}
    r = await jp_fetch("forkd", "v1", "snapshots", method="PUT", body="{}", headers={"Authorization": ""},
                       raise_error=False)
    assert r.code == 401  # auth runs before routing, as in forkd


def test_every_verb_is_authenticated():
    """jupyter_server's convention: each verb carries @web.authenticated (or @allow_unauthenticated)."""
    for _, handler in route_table(""):
        for verb in VERBS:
            method = vars(handler).get(verb)
            if method is None:
                continue
            public = getattr(method, "__allow_unauthenticated", False)
            wrapped = getattr(method, "__wrapped__", None) is not None
            assert public or wrapped, f"{handler.__name__}.{verb} lacks an auth decorator"
            assert public == (handler is HealthHandler)


def test_route_patterns_compile():
    for pattern, _ in route_table("forkd/") + route_table(""):
        re.compile(pattern)


def test_jupyter_server_finds_no_undecorated_endpoint(jp_web_app, forkd_app):
    """jupyter_server's own check (what raises JupyterServerAuthWarning) passes for every forkd route."""
    for pattern, handler in route_table("forkd/") + mcp_routes("forkd/"):
        assert jp_web_app._check_handler_auth(pattern, handler) == [], handler.__name__


async def test_jupyter_lab_keeps_its_own_routes(jp_fetch, forkd_app):
    """Only `forkd serve` drops jupyter-server's routes; inside jupyter lab/server they stay."""
    for path in (("api", "contents"), ("api", "status"), ("api", "me")):
        r = await jp_fetch(*path)
        assert r.code == 200, path
