"""forkd serve's identity provider (forkd_server/identity.py): hmac.compare_digest decides whether a
token matches, never ``==``; no login or logout route."""

from __future__ import annotations

import json

import pytest

from forkd_server import identity
from forkd_server.serve import ForkdServerApp


@pytest.fixture
def jp_server_config(jp_server_config):
    return {**jp_server_config, "ServerApp": {**jp_server_config["ServerApp"],
                                              "identity_provider_class": identity.ForkdIdentityProvider}}


def test_forkd_serve_uses_it():
    assert ForkdServerApp().identity_provider_class is identity.ForkdIdentityProvider


async def test_compare_digest_decides(jp_fetch, forkd_app, jp_serverapp, monkeypatch):
    assert isinstance(jp_serverapp.identity_provider, identity.ForkdIdentityProvider)
    real = jp_serverapp.identity_provider.token
    r = await jp_fetch("forkd", "v1", "sandboxes", headers={"Authorization": "Bearer a-wrong-token"},
                       raise_error=False)
    assert (r.code, json.loads(r.body)) == (401, {"error": "invalid bearer token"})
    calls = []

    def says_same(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return True  # "same" for different tokens: only a provider that asks it lets this one in

    monkeypatch.setattr(identity.hmac, "compare_digest", says_same)
    r = await jp_fetch("forkd", "v1", "sandboxes", headers={"Authorization": "Bearer a-wrong-token"})
    assert r.code == 200 and (b"a-wrong-token", real.encode()) in calls


def test_no_login_route():
    assert identity.ForkdIdentityProvider(token="x" * 20).get_handlers() == []
