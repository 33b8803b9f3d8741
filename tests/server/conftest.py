"""Fixtures for the REST API tests: a jupyter server (pytest_jupyter) with ForkdApp on real sandboxes."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from forkd_server.client import Controller

from ..serving import serving

# pytest_jupyter's server fixtures and its coroutine-test hooks, for this directory only: a
# non-root conftest may not set pytest_plugins, and the plugin's autouse fixtures (a private HOME
# and Jupyter paths per test) must not reach the other suites.
from pytest_jupyter.jupyter_server import *  # noqa: E402,F401,F403


@pytest.fixture
def forkd_data_dir():
    # Unix socket paths are limited to 107 bytes: keep the data dir short.
    path = tempfile.mkdtemp(prefix="fk")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def jp_server_config(forkd_data_dir):
    return {
        "ServerApp": {
            "jpserver_extensions": {"forkd_server": True, "jupyter_server_terminals": False},
            "allow_unauthenticated_access": False,
        },
        # remote_url: a forkd of its own, whatever FORKD_URL the shell running the tests has
        "ForkdApp": {"data_dir": forkd_data_dir, "branch_concurrency": 4, "remote_url": ""},
    }


@pytest.fixture
def forkd_app(jp_serverapp):
    """The ForkdApp instance; everything it made is killed and deleted when the test ends."""
    app = jp_serverapp.web_app.settings["forkd"]
    yield app
    ctl = app.controller
    if ctl is None:
        return
    for ws in ctl.list_workspaces():  # first: a workspace's state snapshot refuses a plain delete
        ctl.delete_workspace(ws["name"])
    for sb in ctl.list_sandboxes():
        ctl.kill_sandbox(sb["id"])
    for snap in sorted(ctl.list_snapshots(), key=lambda s: -len(s.get("lineage", []))):
        try:
            ctl.delete_snapshot(snap["tag"], cascade=True)
        except Exception:  # noqa: BLE001 - already gone with its parent
            pass


# --- a real ``forkd serve`` for the modules that drive one as a user does (SDK, CLI, sessions) ----

@pytest.fixture(scope="module")
def server():
    """This module's own ``forkd serve`` (``tests.serving.serving``); a module may override it."""
    with serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def ctl(server):
    return Controller(server.url, server.token)
