"""A store that is full, and one that is slow: each fails the push or pull with an error that names
the store and says what to do, and leaves nothing half-written that a later pull would trust.

- Full: a ``file://`` store on a small tmpfs this module mounts (root needed), through the engine's
  push and through ``forkd serve --store file://...`` on the VM engine (the snapshot stays ready and
  spawns); after the store has room again, pushing again uploads only what it lacks.
- Slow: an endpoint that accepts connections and never answers, with the request timeout set
  (``RemoteStore(timeout=)``, ``forkd serve --store-timeout``): the error says the store did not
  answer within that time, and how to give it longer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import socket
import subprocess
import tempfile

import pytest

from forkd_engine.store import (CHUNK_SIZE, ChunkCache, RemoteStore, StoreError, fetch_manifest, materialise, persist,
                                pull, push)
from forkd_engine.store import chunks as ck
from forkd_server.client import Controller, ControllerError

from ..conftest import requires_root
from ..rest import exchange
from ..serving import serving
from ..vm.conftest import requires_qemu
from .s3 import S3_ENV

pytestmark = requires_root

REQUIRES = {"qemu": "QEMU emulator version 7.2.0", "machine": "microvm", "accel": "tcg", "cpu": "max",
            "mem_mib": 64, "image": "abc"}


@contextlib.contextmanager
def tmpfs(size: str):
    """A tmpfs of ``size`` mounted on a directory of its own (unmounted and removed after)."""
    where = tempfile.mkdtemp(prefix="fkstore")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the test needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)
        os.rmdir(where)


def store_files(root: str) -> dict[str, list[str]]:
    """Every file under a folder store, by its top folder (chunks, manifests, tags, anything else)."""
    found: dict[str, list[str]] = {}
    for path, _dirs, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(path, name), root)
            found.setdefault(rel.split(os.sep)[0], []).append(rel)
    return found


def assert_nothing_half_written(root: str) -> None:
    """No manifest and no tag, and each chunk object whole: it decompresses to what its name says."""
    found = store_files(root)
    assert set(found) <= {"chunks"}, found  # no manifest, no tag, no temporary file left behind
    for rel in found.get("chunks", []):
        with open(os.path.join(root, rel), "rb") as f:
            data = ck.decompress(f.read(), CHUNK_SIZE)
        assert hashlib.sha256(data).hexdigest() == os.path.basename(rel), rel


def test_a_full_folder_store_fails_the_push_saying_so_and_keeps_nothing_half_written(tmp_path):
    rng = random.Random(3)
    src = tmp_path / "memory.bin"
    src.write_bytes(rng.randbytes(4 * CHUNK_SIZE))  # random: each chunk stays ~4 MiB compressed
    cache = ChunkCache(str(tmp_path / "cache"))
    m = persist(cache, {"memory.bin": str(src)}, REQUIRES, {"tag": "big"})
    with tmpfs("6m") as mount:  # room for one chunk of four
        url = f"file://{mount}/store"
        with pytest.raises(StoreError) as err:
            push(cache, RemoteStore(url), m.digest, tag="big")
        text = str(err.value)
        assert text.startswith(f"store {url}: writing chunks/"), text
        assert "the store is full; free space in it" in text and "No space left on device" in text, text
        assert_nothing_half_written(os.path.join(mount, "store"))
        with pytest.raises(StoreError, match="holds no snapshot|no snapshot tagged"):
            fetch_manifest(RemoteStore(url), tag="big")
        held = len(store_files(os.path.join(mount, "store")).get("chunks", []))

        subprocess.run(["mount", "-o", "remount,size=64m", mount], check=True)  # room again
        out = push(cache, RemoteStore(url), m.digest, tag="big")
        assert out["uploaded_chunks"] == out["chunks"] - held  # only what the store lacked
        other = ChunkCache(str(tmp_path / "other"))
        manifest = fetch_manifest(RemoteStore(url), tag="big")
        pull(other, RemoteStore(url), manifest)
        materialise(other, manifest, {"memory.bin": str(tmp_path / "back.bin")})
        assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


@contextlib.contextmanager
def silent_endpoint():
    """``http://127.0.0.1:PORT`` of a socket that accepts connections (the kernel completes them into
    its backlog) and never reads or answers a request."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_a_store_that_never_answers_fails_within_its_timeout_saying_so(monkeypatch):
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    with silent_endpoint() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        remote = RemoteStore("s3://forkd/slow", timeout=1)
        with pytest.raises(StoreError) as err:
            remote.get_tag("np")
    text = str(err.value)
    assert text.startswith("store s3://forkd/slow: reading tags/np failed: the store did not answer within 1 s"), text
    assert "--store-timeout" in text and S3_ENV["AWS_SECRET_ACCESS_KEY"] not in text and "Debug" not in text
    for bad in (0, -1, "soon", float("inf")):
        with pytest.raises(StoreError, match="give a number of seconds above 0"):
            RemoteStore("memory://", timeout=bad)


def test_forkd_serve_store_timeout_bounds_a_pull_from_a_store_that_never_answers():
    with silent_endpoint() as endpoint:
        env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        with serving("--store", "s3://forkd/slow", "--store-timeout", "1.5", env=env) as srv:
            status, body = exchange(srv.url + "/v1/snapshots/pull", "POST", {"tag": "np"},
                                    {"Authorization": f"token {srv.token}"}, timeout=120)
    assert status == 502, body
    assert "store s3://forkd/slow" in body["error"] and "did not answer within 1.5 s" in body["error"], body
    assert "--store-timeout" in body["error"] and S3_ENV["AWS_SECRET_ACCESS_KEY"] not in body["error"], body


@requires_qemu
@pytest.mark.slow  # a VM snapshot under TCG
def test_a_push_to_a_full_store_is_a_502_saying_what_to_do_and_the_snapshot_is_unharmed():
    with tmpfs("4m") as mount, serving("--store", f"file://{mount}/store") as srv:
        ctl = Controller(srv.url, srv.token)
        ctl.create_snapshot("tiny", engine="vm", mem_size_mib=192, setup="x = 20")
        with pytest.raises(ControllerError) as err:
            ctl.push_snapshot("tiny")
        assert err.value.status == 502, err.value.body
        text = err.value.message
        assert f"push of tiny: store file://{mount}/store: writing " in text, text
        assert "the store is full; free space in it" in text and "tiny is unharmed here" in text, text
        assert "Traceback" not in text
        assert_nothing_half_written(os.path.join(mount, "store"))
        info = ctl.snapshot_info("tiny")
        assert info["status"] == "ready" and info["stored"]["remote"] is False, info
        (kid,) = ctl.spawn_sandboxes("tiny")
        assert ctl.eval_code(kid["id"], "x + 1")["result"] == "21"
        ctl.kill_sandbox(kid["id"])
