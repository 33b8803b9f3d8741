"""The store on Azure Blob Storage and Google Cloud Storage, as far as this machine can try them.

az://: against Azurite, Azure's own Blob Storage emulator (a real server, in memory on loopback):
push, a diff branch that uploads only its changed chunk, create mode (nothing rewritten), a pull
that verifies every chunk and fails closed on a tampered one, a delete that keeps what another
snapshot uses, ``forkd serve --store az://...`` deleting through its route, and the failures (no
container, a wrong key, nothing listening, no account) named with what to set, the key never said.

gs://: no GCS server can run here (fake-gcs-server and gcp-storage-emulator lack the XML API that
obstore's GCS client speaks), so only what needs none: opening a store from a service account's
file, a store that does not answer, a missing credentials file and S3's flags, each named with
what to set, the private key never said. A push to real GCS is untested.
"""

from __future__ import annotations

import base64
import json
import os
import secrets

import pytest

from forkd_engine.store import (CHUNK_SIZE, ChunkCache, ChunkCorrupt, NotInStore, RemoteStore, StoreError, delete,
                                fetch_manifest, persist, pull, push)
from forkd_server.client import Controller

from ..serving import serving
from .azurite import KEY, MISSING, azurite, emulator_env
from .test_store import REQUIRES, files_of

@pytest.fixture(scope="module")
def blob_url():
    if MISSING:
        pytest.skip(MISSING)
    with azurite() as url:
        yield url


@pytest.fixture
def emulator(blob_url, monkeypatch):
    for name, value in emulator_env(blob_url).items():
        monkeypatch.setenv(name, value)
    return blob_url


def two_snapshots(tmp_path, cache: ChunkCache):
    """a, and b: a diff branch of a that changed one page of one chunk."""
    files = files_of(tmp_path, "a", 31)
    a = persist(cache, files, REQUIRES, {"tag": "a"})
    data = bytearray(open(files["memory.bin"], "rb").read())
    data[3 * CHUNK_SIZE + 7] ^= 1
    (tmp_path / "b.bin").write_bytes(data)
    b = persist(cache, {"memory.bin": str(tmp_path / "b.bin"), "devices.bin": files["devices.bin"]}, REQUIRES,
                {"tag": "b"})
    return a, b


def test_azure_push_pull_tamper_and_delete(emulator, tmp_path):
    remote = RemoteStore(f"az://forkd/team-{secrets.token_hex(3)}")
    cache = ChunkCache(str(tmp_path / "cache"))
    a, b = two_snapshots(tmp_path, cache)
    first = push(cache, remote, a.digest, tag="a")
    assert first["uploaded_chunks"] == len(set(a.chunks())) > 1
    assert push(cache, remote, a.digest, tag="a")["uploaded_chunks"] == 0  # create mode: nothing rewritten
    assert push(cache, remote, b.digest, tag="b")["uploaded_chunks"] == 1  # only the changed chunk
    fresh = ChunkCache(str(tmp_path / "fresh"))
    got = fetch_manifest(remote, tag="b")
    assert got.digest == b.digest and pull(fresh, remote, got)["fetched_chunks"] == len(set(b.chunks()))
    assert fresh.has_all(b)

    victim = next(c for c in a.chunks() if c not in b.chunks())  # a's own chunk, flipped in the store
    blob = bytearray(remote.get_chunk(victim))
    blob[-5] ^= 0x40
    remote.delete(remote.chunk_path(victim))
    remote.put_chunk(victim, bytes(blob))
    other = ChunkCache(str(tmp_path / "other"))
    with pytest.raises(ChunkCorrupt) as err:
        pull(other, remote, fetch_manifest(remote, tag="a"))
    assert victim in str(err.value) and remote.url in str(err.value) and not other.has(victim)

    out = delete(remote, a.digest, grace_seconds=0)
    assert out["removed_chunks"] == len(set(a.chunks()) - set(b.chunks()))
    assert {m["path"].rsplit("/", 1)[1] for m in remote.list("chunks/")} == set(b.chunks())
    with pytest.raises(NotInStore):
        fetch_manifest(remote, tag="a")


def test_azure_failures_are_named_with_what_to_set(emulator, monkeypatch):
    with pytest.raises(StoreError) as no_container:
        RemoteStore("az://nowhere/x").put_tag("t", "sha256:" + "ab" * 32)
    assert str(no_container.value).startswith("store az://nowhere/x: writing tags/t: ")
    assert "ContainerNotFound: The specified container does not exist." in str(no_container.value)
    assert "RequestId" not in str(no_container.value)  # the store's message, not its request's bookkeeping

    wrong = base64.b64encode(secrets.token_bytes(64)).decode()  # a key the emulator's account does not have
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", wrong)
    with pytest.raises(StoreError) as denied:
        RemoteStore("az://forkd/x").get_tag("t")
    text = str(denied.value)
    assert text.startswith("store az://forkd/x: reading tags/t: access denied") and "AuthorizationFailure" in text
    assert "AZURE_STORAGE_ACCOUNT_KEY" in text and wrong not in text and KEY not in text
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_KEY")

    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(StoreError) as unreachable:
        RemoteStore("az://forkd/x").get_tag("t")
    assert str(unreachable.value).startswith("store az://forkd/x: reading tags/t failed: ")
    assert "error sending request" in str(unreachable.value) and "Debug" not in str(unreachable.value)

    monkeypatch.delenv("AZURE_STORAGE_USE_EMULATOR")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(StoreError) as no_account:
        RemoteStore("az://forkd/x")
    assert str(no_account.value) == ("store az://forkd/x: cannot open it: Generic MicrosoftAzure error: Account must "
                                     "be specified; set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY "
                                     "(or AZURE_STORAGE_SAS_TOKEN)")


def test_forkd_serve_on_an_azure_store_deletes_through_its_route(emulator, tmp_path):
    store = f"az://forkd/serve-{secrets.token_hex(3)}"
    remote = RemoteStore(store)
    cache = ChunkCache(str(tmp_path / "cache"))
    a, b = two_snapshots(tmp_path, cache)
    push(cache, remote, a.digest, tag="a")
    push(cache, remote, b.digest, tag="b")
    # the server finds the store from the same variables (the fixture set them in this environment)
    with serving("--store", store, env={**os.environ, "FORKD_STORE_DELETE_GRACE": "0"}) as srv:
        out = Controller(srv.url, srv.token).delete_remote_snapshot("a")
    assert out["digest"] == a.digest and out["store"] == store
    assert out["removed_chunks"] == len(set(a.chunks()) - set(b.chunks()))
    assert [m["path"] for m in remote.list("manifests/")] == [f"manifests/{b.digest[7:]}"]


# --- gs://: what can be tried without a GCS server -------------------------------------------------

PRIVATE_KEY = "-----BEGIN PRIVATE KEY-----not-a-real-key-7f3a-----END PRIVATE KEY-----"


def service_account(tmp_path, base_url: str) -> str:
    path = tmp_path / "service-account.json"
    path.write_text(json.dumps({"gcs_base_url": base_url, "disable_oauth": True, "client_email": "forkd@example",
                                "private_key": PRIVATE_KEY, "private_key_id": "k1"}))
    return str(path)


def test_gcs_failures_are_named_with_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", service_account(tmp_path, "https://127.0.0.1:9"))  # nothing there
    remote = RemoteStore("gs://forkd/team")
    with pytest.raises(StoreError) as unreachable:
        remote.get_tag("t")
    text = str(unreachable.value)
    assert text.startswith("store gs://forkd/team: reading tags/t failed: ") and "error sending request" in text
    assert PRIVATE_KEY not in text and "not-a-real-key" not in text and "Debug" not in text

    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(tmp_path / "none.json"))
    with pytest.raises(StoreError) as missing:
        RemoteStore("gs://forkd/team")
    text = str(missing.value)
    assert text.startswith("store gs://forkd/team: cannot open it: ") and str(tmp_path / "none.json") in text
    assert text.endswith("; set GOOGLE_SERVICE_ACCOUNT (a service account's JSON file) or "
                         "GOOGLE_APPLICATION_CREDENTIALS")

    monkeypatch.delenv("GOOGLE_SERVICE_ACCOUNT")  # the key itself in the environment: never said either
    key = json.dumps({"gcs_base_url": "https://127.0.0.1:9", "disable_oauth": True, "client_email": "forkd@example",
                      "private_key": PRIVATE_KEY, "private_key_id": "k1"})
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", key)
    with pytest.raises(StoreError) as unreachable:
        RemoteStore("gs://forkd/team").get_tag("t")
    assert "error sending request" in str(unreachable.value) and "not-a-real-key" not in str(unreachable.value)

    with pytest.raises(StoreError) as flags:  # forkd serve --store gs://... --store-endpoint URL
        RemoteStore("gs://forkd/team", endpoint="http://127.0.0.1:9")
    assert str(flags.value) == ("store gs://forkd/team: endpoint (--store-endpoint) is a setting of s3:// stores; a "
                                "gs:// store takes its settings from GOOGLE_SERVICE_ACCOUNT (a service account's "
                                "JSON file) or GOOGLE_APPLICATION_CREDENTIALS")
