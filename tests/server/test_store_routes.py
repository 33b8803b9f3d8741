"""The store's routes through jupyter lab's extension (ForkdApp.store), with a folder as the remote
store: the trait reaches the controller, and what needs no VM answers as documented."""

from __future__ import annotations

import pytest

from .test_api import call


@pytest.fixture
def remote_dir(tmp_path):
    return tmp_path / "remote"


@pytest.fixture
def jp_server_config(forkd_data_dir, remote_dir):
    return {
        "ServerApp": {"jpserver_extensions": {"forkd_server": True, "jupyter_server_terminals": False},
                      "allow_unauthenticated_access": False},
        "ForkdApp": {"data_dir": forkd_data_dir, "store": f"file://{remote_dir}"},
    }


async def test_the_extension_trait_names_the_store(jp_fetch, forkd_app, remote_dir):
    assert forkd_app.controller.stores.remote.url == f"file://{remote_dir}"
    status, body = await call(jp_fetch, "POST", "snapshots", "pull", body={"tag": "nope"})
    assert status == 404 and f"store file://{remote_dir} has no snapshot tagged 'nope'" in body["error"]
    assert body["error"].endswith("\npush it there first, from a server of the same store that has it")
    assert body["details"]["cli"] == "forkd push nope"
    status, body = await call(jp_fetch, "POST", "snapshots", "pull", body={"digest": "sha256:" + "ab" * 32})
    assert status == 404 and "holds no snapshot" in body["error"]
    status, body = await call(jp_fetch, "POST", "snapshots", "pull", body={"digest": "sha256:xyz"})
    assert status == 400 and "not a snapshot digest" in body["error"]
    status, body = await call(jp_fetch, "POST", "snapshots", "pull", body={})
    assert status == 400 and 'exactly one of "tag" and "digest"' in body["error"]
    status, body = await call(jp_fetch, "POST", "snapshots", "nope", "push")
    assert status == 404
    status, _ = await call(jp_fetch, "DELETE", "snapshots", "pull")  # the path of a snapshot tagged pull
    assert status == 404


async def test_a_process_snapshot_cannot_be_pushed_and_says_why(jp_fetch, forkd_app):
    forkd_app.controller.create_snapshot("proc", engine="process", setup="x = 1")
    status, body = await call(jp_fetch, "POST", "snapshots", "proc", "push")
    assert status == 409 and "parked process" in body["error"]
    status, body = await call(jp_fetch, "GET", "snapshots")
    assert "stored" not in body[0]  # nothing in the store for it: no stored object
