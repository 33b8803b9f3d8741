"""``DELETE /v1/store/snapshots/{tag|digest}`` through a real ``forkd serve --store s3://...`` (moto
on loopback): the snapshot's manifest and tag go, chunks another manifest lists stay (moto's log
holds every one), and the other snapshot still pulls whole. No VM needed: the two snapshots
are written into the store as a host's store writes them."""

from __future__ import annotations

import os
import secrets

import pytest

from forkd_engine.store import CHUNK_SIZE, ChunkCache, RemoteStore, fetch_manifest, persist, pull, push
from forkd_engine.store.remote import s3_options_from_env
from forkd_server.client import Controller, ControllerError

from ..serving import serving
from .s3 import S3_ENV, moto_s3
from .test_store import REQUIRES, files_of

# A prefix of its own: moto keeps its buckets per process, so other modules' objects may be in "forkd"
STORE = f"s3://forkd/delete-{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as (endpoint, log):
        yield {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint}, log


@pytest.fixture(scope="module")
def server(s3):
    # grace 0: every unlisted chunk is swept at once (nothing else pushes to this store meanwhile)
    with serving("--store", STORE, env={**s3[0], "FORKD_STORE_DELETE_GRACE": "0"}) as srv:
        yield srv


def two_snapshots(tmp_path, env: dict):
    """Snapshots a and b in the store, b a branch of a that changed one chunk: (a, b, remote)."""
    remote = RemoteStore(STORE, **s3_options_from_env(env))
    cache = ChunkCache(str(tmp_path / "cache"))
    files = files_of(tmp_path, "a", 11)
    a = persist(cache, files, REQUIRES, {"tag": "a"})
    data = bytearray(open(files["memory.bin"], "rb").read())
    data[3 * CHUNK_SIZE + 7] ^= 1
    (tmp_path / "b.bin").write_bytes(data)
    b = persist(cache, {"memory.bin": str(tmp_path / "b.bin"), "devices.bin": files["devices.bin"]},
                REQUIRES, {"tag": "b"})
    push(cache, remote, a.digest, tag="a")
    push(cache, remote, b.digest, tag="b")
    return a, b, remote


def test_deleting_a_snapshot_keeps_the_chunks_another_uses(server, s3, tmp_path):
    env, _log = s3
    a, b, remote = two_snapshots(tmp_path, env)
    shared = set(a.chunks()) & set(b.chunks())
    assert shared and set(a.chunks()) - shared
    ctl = Controller(server.url, server.token)
    out = ctl.delete_remote_snapshot("a")
    assert out["digest"] == a.digest and out["store"] == STORE
    assert out["removed_chunks"] == len(set(a.chunks()) - shared)
    left = {m["path"].rsplit("/", 1)[1] for m in remote.list("chunks/")}
    assert left == set(b.chunks())  # every chunk b lists stays, and only those
    fresh = ChunkCache(str(tmp_path / "fresh"))
    pull(fresh, remote, fetch_manifest(remote, tag="b"))
    assert fresh.has_all(b)  # b still pulls whole
    with pytest.raises(ControllerError) as err:
        ctl.delete_remote_snapshot("a")
    assert err.value.status == 404 and "'a'" in err.value.what
    out = ctl.delete_remote_snapshot(digest=b.digest)  # by digest: the last one, so every chunk goes
    assert out["removed_chunks"] == len(set(b.chunks())) and out["kept_chunks"] == 0


def test_bad_references_are_4xx(server):
    ctl = Controller(server.url, server.token)
    for ref, status in (("sha256:xyz", 400), ("sha256:" + "ab" * 32, 404), ("no-such-tag", 404), ("-bad", 400)):
        with pytest.raises(ControllerError) as err:
            ctl.delete_remote_snapshot(ref)
        assert err.value.status == status, (ref, err.value)
