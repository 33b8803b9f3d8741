"""Remote mode's settings (forkd_server/remote.py): where the URL and the token come from, what is
refused, and that ``forkd serve`` never forwards. The forwarding itself: tests/fleet/test_jupyter_remote.py."""

from __future__ import annotations

import os

import pytest

from forkd_server.app import ForkdApp, default_token
from forkd_server.client import Controller
from forkd_server.serve import build_argv
from tests.serving import free_port, serving


def test_the_remote_is_found_as_the_sdk_finds_its_server(monkeypatch):
    monkeypatch.setenv("FORKD_URL", "http://router.internal:8890")
    monkeypatch.setenv("FORKD_TOKEN", "router-token")
    app = ForkdApp()
    assert (app.remote_url, app.remote_token) == ("http://router.internal:8890", "router-token")
    monkeypatch.delenv("FORKD_URL")
    assert ForkdApp().remote_url == ""  # no FORKD_URL: a forkd of its own


def test_under_jupyterhub_the_servers_own_token_is_the_fallback():
    assert default_token({"FORKD_TOKEN": "a", "JUPYTERHUB_API_TOKEN": "b"}) == "a"
    assert default_token({"JUPYTERHUB_API_TOKEN": "b"}) == "b"
    assert default_token({}) == ""


def test_a_remote_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="http:// or https://"):
        ForkdApp(remote_url="router.internal:8890")
    assert ForkdApp(remote_url="  https://r.example/services/forkd ").remote_url == "https://r.example/services/forkd"


def test_forkd_serve_never_forwards(monkeypatch, tmp_path):
    monkeypatch.setenv("FORKD_URL", "http://router.internal:8890")
    assert "--ForkdApp.remote_url=" in build_argv(data_dir=str(tmp_path))[0]
    # a real one, started from a shell whose FORKD_URL names a server that is not there, serves its own
    with serving(env={**os.environ, "FORKD_URL": f"http://127.0.0.1:{free_port()}"}) as srv:
        assert Controller(srv.url, srv.token).list_sandboxes() == []
