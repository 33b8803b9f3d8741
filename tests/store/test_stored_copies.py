"""A stored sandbox's copy in the remote store is its state while it is stored, not a save point:
through the MCP tools on a real ``forkd serve --store s3://...`` (moto on loopback) on the VM
engine, a sandbox is frozen, stored (its state pushed) and woken with its state, and then its copy
leaves the store; one killed while stored leaves it too; one still stored keeps it; a delete the
store could not take (it was down) is done when the server starts again. And a pushed
snapshot that another host deleted from the store is no longer marked ``remote`` here once a
delete finds it gone."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
import urllib.request

import pytest

pytest.importorskip("mcp.server.mcpserver")  # mcp 2.x (forkd_server.mcp.SUPPORTED)

from mcp import Client  # noqa: E402

from forkd_engine.store import NotInStore, RemoteStore, fetch_manifest  # noqa: E402
from forkd_engine.store.remote import s3_options_from_env  # noqa: E402
from forkd_server.client import Controller, ControllerError  # noqa: E402
from forkd_server.mcp import build_server  # noqa: E402

from ..serving import serving  # noqa: E402
from ..vm.conftest import requires_qemu  # noqa: E402
from .s3 import S3_ENV, moto_s3  # noqa: E402

pytestmark = [requires_qemu, pytest.mark.slow]

STORE = f"s3://forkd/tiers-{secrets.token_hex(4)}"  # a prefix of its own: moto keeps buckets per process


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as (endpoint, _log):
        yield {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint}


@pytest.fixture(scope="module")
def host(s3):
    # grace 0: a deleted state's chunks are swept at once (nothing else pushes to this store meanwhile)
    with serving("--store", STORE, env={**s3, "FORKD_STORE_DELETE_GRACE": "0"}) as srv:
        yield srv


def stored_states(remote: RemoteStore) -> dict[str, str]:
    """{the tag in its manifest (``<id>@stored-<n>``): digest} of every manifest in the store."""
    found = {}
    for meta in remote.list("manifests/"):
        digest = "sha256:" + meta["path"].rsplit("/", 1)[1]
        try:
            found[fetch_manifest(remote, digest=digest).meta.get("tag")] = digest
        except NotInStore:  # deleted since the listing: the server's delete runs meanwhile
            continue
    return found


def chunks_in(remote: RemoteStore) -> set[str]:
    return {m["path"].rsplit("/", 1)[1] for m in remote.list("chunks/")}


def until(look, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not look():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tiny(host):
    ctl = Controller(host.url, host.token)
    ctl.create_snapshot("tiny", engine="vm", mem_size_mib=192, setup="x = 20")
    yield "tiny"
    ctl.delete_snapshot("tiny")


def test_a_woken_or_killed_sandbox_leaves_no_copy_in_the_remote_store(host, s3, tiny):
    ctl = Controller(host.url, host.token)
    remote = RemoteStore(STORE, **s3_options_from_env(s3))
    a, b, c = [s["id"] for s in ctl.spawn_sandboxes("tiny", 3)]
    for sid, step in ((a, 1), (b, 2), (c, 3)):
        assert not ctl.run_code(sid, f"x += {step}").get("error")

    async def scenario():
        async with Client(build_server(ctl)) as mcp:
            async def call(tool, **args):
                result = await mcp.call_tool(tool, args)
                assert not result.is_error, result.content[0].text
                return result.structured_content

            frozen = await call("freeze_sandbox", sandbox_id=a)
            stored = [await call("store_sandbox", sandbox_id=sid) for sid in (a, b, c)]  # a frozen, b, c running
            held = stored_states(remote)
            woke = await call("wake_sandbox", sandbox_id=a)
            value = await call("eval_code", sandbox_id=a, code="x")
            killed = await call("kill_sandbox", sandbox_id=b)  # killed while stored
            return frozen, stored, held, woke, value, killed

    try:
        frozen, stored, held, woke, value, killed = asyncio.run(scenario())
        assert frozen["tier"] == "frozen" and [s["tier"] for s in stored] == ["stored"] * 3
        assert {tag.split("@")[0] for tag in held} == {a, b, c}  # each stored state pushed, under its own tag
        assert woke["tier"] == "running" and woke["wake"]["from"] == "stored" and value["result"] == "21"
        assert killed == {"id": b, "killed": True}
        # a's and b's copies go (off the wake's path: polled), c's stays: c is still stored in it; swept
        # at once (grace 0), only the chunks c's state lists are left
        c_chunks = set(fetch_manifest(remote, digest=next(d for t, d in held.items() if t.startswith(c + "@")))
                       .chunks())
        until(lambda: {t.split("@")[0] for t in stored_states(remote)} == {c} and chunks_in(remote) == c_chunks,
              "the woken and the killed sandbox's stored states leave the store")
        assert ctl.eval_code(c, "x")["result"] == "23"  # c wakes from its copy on its next call
        until(lambda: stored_states(remote) == {} and chunks_in(remote) == set(),
              "c's stored state leaves the store after its wake")
    finally:
        for s in ctl.list_sandboxes():
            ctl.kill_sandbox(s["id"])


def test_a_snapshot_another_host_deleted_from_the_store_is_no_longer_marked_remote(host, s3, tiny):
    ctl = Controller(host.url, host.token)
    remote = RemoteStore(STORE, **s3_options_from_env(s3))
    for ref in ("tiny", None):  # by tag, then by digest
        digest = ctl.push_snapshot(tiny)["digest"]
        assert ctl.snapshot_info(tiny)["stored"] == {"digest": digest, "remote": True}
        remote.delete(f"manifests/{digest.split(':')[1]}")  # as another host of the store would
        remote.delete("tags/tiny")
        with pytest.raises(ControllerError) as gone:
            ctl.delete_remote_snapshot(ref, digest=None if ref else digest)
        assert gone.value.status == 404
        assert ctl.snapshot_info(tiny)["stored"] == {"digest": digest, "remote": False}


def test_a_delete_the_store_could_not_take_is_done_when_the_server_starts_again(tmp_path):
    """The store is down when the sandbox wakes: the wake goes on (its chunks are here), the delete of
    its copy fails, is said, and stays recorded; the next start of the server deletes it."""
    import signal

    from moto.server import ThreadedMotoServer

    from ..serving import free_port

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    moto.start()
    store = f"s3://forkd/later-{secrets.token_hex(4)}"
    try:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/forkd", method="PUT"), timeout=30).read()
        env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint, "FORKD_STORE_DELETE_GRACE": "0"}
        remote = RemoteStore(store, **s3_options_from_env(env))
        with serving("--store", store, env=env) as srv:
            ctl = Controller(srv.url, srv.token)
            ctl.create_snapshot("tiny", engine="vm", mem_size_mib=192, setup="x = 20")
            sid = ctl.spawn_sandboxes("tiny", 1)[0]["id"]
            assert ctl.store_sandbox(sid)["tier"] == "stored"
            assert [t.split("@")[0] for t in stored_states(remote)] == [sid]
            moto.stop()  # the store goes away (its objects stay in this process: moto keeps them)
            assert ctl.wake_sandbox(sid)["wake"]["from"] == "stored"  # from the local store
            until(lambda: f"stays in {store} for now" in srv.output(), "the failed delete is said")
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
            moto.start()  # the store is back, the copy still in it
            assert [t.split("@")[0] for t in stored_states(remote)] == [sid]
            srv.proc.send_signal(signal.SIGTERM)
            srv.proc.wait(60)
            srv._start()
            srv.wait_healthy()
            until(lambda: stored_states(remote) == {}, "the next start deletes the copy")
            assert ctl.eval_code(sid, "x")["result"] == "20"  # the woken sandbox runs on, untouched
    finally:
        moto.stop()
