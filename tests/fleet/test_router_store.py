"""``DELETE /v1/store/snapshots/{tag|digest}`` through ``forkd router``, in front of three real
``forkd serve`` hosts (process engine): two share one S3 store (moto on loopback), the one between
them has none. The router asks each up host in turn: the first host of the store deletes the
snapshot, the second finds it gone, the one without a store is passed over; a snapshot no store
holds is the hosts' 404, a bad reference their 400. No VM needed: the snapshots are written into
the store as a host's store writes them."""

from __future__ import annotations

import os
import secrets

import pytest

from forkd_engine.store import ChunkCache, RemoteStore, persist, push
from forkd_engine.store.remote import s3_options_from_env
from forkd_server.client import Controller, ControllerError

from ..store.s3 import S3_ENV, moto_s3
from ..store.test_store import REQUIRES, files_of
from .fleet import fleet

STORE = f"s3://forkd/fleet-{secrets.token_hex(4)}"  # a prefix of its own: moto keeps buckets per process


@pytest.fixture(scope="module")
def world():
    with moto_s3() as (endpoint, _log):
        env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the hosts inherit it (fleet() passes os.environ)
        try:
            store = ["--store", STORE]
            with fleet(3, host_args=[store, [], store]) as (router, hosts):
                yield router, hosts, RemoteStore(STORE, **s3_options_from_env({**os.environ, **env}))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_a_delete_from_the_store_reaches_it_through_the_hosts_that_have_it(world, tmp_path):
    router, hosts, remote = world
    cache = ChunkCache(str(tmp_path / "cache"))
    a = persist(cache, files_of(tmp_path, "a", 21), REQUIRES, {"tag": "a"})
    b = persist(cache, files_of(tmp_path, "b", 22), REQUIRES, {"tag": "b"})
    push(cache, remote, a.digest, tag="a")
    push(cache, remote, b.digest, tag="b")
    api = Controller(router.url, router.token)

    out = api.delete_remote_snapshot("a")
    assert out["digest"] == a.digest and out["store"] == STORE
    assert out["hosts"] == [hosts[0].url] and out["host"] == hosts[0].url  # host 2 found it gone
    manifests = {m["path"].rsplit("/", 1)[1] for m in remote.list("manifests/")}
    assert manifests == {b.digest.split(":")[1]}  # a's manifest went, b's stays
    with pytest.raises(ControllerError) as again:
        api.delete_remote_snapshot("a")
    assert again.value.status == 404 and "'a'" in again.value.what  # the store's host says so, not "no store"
    with pytest.raises(ControllerError) as bad:
        api.delete_remote_snapshot("sha256:xyz")
    assert bad.value.status == 400 and "no remote store" not in bad.value.message
    out = api.delete_remote_snapshot(digest=b.digest)
    assert out["digest"] == b.digest and out["hosts"] == [hosts[0].url]
    assert remote.list("manifests/") == []
    with pytest.raises(ControllerError) as direct:  # the host without a store, asked directly, refuses
        Controller(hosts[1].url, hosts[1].token).delete_remote_snapshot("b")
    assert direct.value.status == 400 and "no remote store" in direct.value.what


def test_one_answer_for_the_hosts_answers():
    from forkd_server.fleet.handlers.snapshots import store_delete_answer
    done = {"digest": "sha256:ab", "store": STORE, "removed_chunks": 3, "kept_chunks": 0}
    gone = {"error": "store s3://x has no snapshot tagged 'a'"}
    none = {"error": "this server has no remote store\nstart it with `forkd serve --store ...`"}
    failed = {"error": "delete of a from the store: store s3://y: listing manifests/ failed: timed out"}
    assert store_delete_answer([("h0", 400, none), ("h1", 200, done), ("h2", 404, gone)]) == (
        200, {**done, "host": "h1", "hosts": ["h1"]})
    # a store that failed is said (retrying is safe: where it went, it is a 404 next time)
    assert store_delete_answer([("h0", 200, done), ("h1", 502, failed)]) == (
        502, {**failed, "host": "h1", "deleted_by": ["h0"]})
    assert store_delete_answer([("h0", 400, none), ("h1", 404, gone)]) == (404, gone)
    assert store_delete_answer([("h0", 400, none), ("h1", 400, none)]) == (400, none)
