"""Snapshots that last and travel, end to end: real ``forkd serve`` servers on the VM engine (TCG
here: guests are small and the snapshots are shared by the tests, in order) and a real S3 server
(moto on loopback) as the remote store."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from forkd_engine.store import fetch_manifest
from forkd_server.client import Controller

from ..rest import exchange
from ..serving import FORKD, serving
from ..vm.conftest import requires_qemu
from .s3 import S3_ENV, moto_s3

pytestmark = [requires_qemu, pytest.mark.slow]  # servers on the VM engine (TCG): ~30-40 s, started early under -n

SETUP = """
import numpy as np
x = 41
arr = np.random.default_rng(7).random(3_000_000)
total = repr(float(arr.sum()))
"""


def mem_root(srv) -> str:
    """The tmpfs folder of a server's guest RAM files (as the VM engine names it)."""
    digest = hashlib.sha1(os.path.realpath(os.path.join(srv.data_dir, "vm")).encode()).hexdigest()[:12]
    return f"/dev/shm/forkd-vm-{digest}"


def snapshot_file(srv, tag: str, name: str) -> str:
    """Where a server's VM engine keeps file ``name`` of snapshot ``tag`` (memory.bin in tmpfs)."""
    if name == "memory.bin":
        return os.path.join(mem_root(srv), tag, name)
    return os.path.join(srv.data_dir, "vm", "snapshots", tag, name)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def restart(srv) -> None:
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(60)
    srv._start()
    srv.wait_healthy()


def call(srv, method: str, path: str, body=None) -> tuple[int, dict]:
    return exchange(srv.url + path, method, body, {"Authorization": f"token {srv.token}"}, timeout=600)


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as (endpoint, log):
        yield {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint}, log


@pytest.fixture(scope="module")
def host_a(s3):
    with serving("--store", "s3://forkd/team", env=s3[0]) as srv:
        yield srv


@pytest.fixture(scope="module")
def host_b(s3):
    with serving("--store", "s3://forkd/team", env=s3[0]) as srv:
        yield srv


@pytest.fixture(scope="module")
def pushed(host_a):
    """Snapshot ``np`` made on host A (numpy, a 3M-float array) and pushed: its digest."""
    a = Controller(host_a.url, host_a.token)
    a.create_snapshot("np", engine="vm", mem_size_mib=256, packages=["python3-numpy"], setup=SETUP)
    out = a.push_snapshot("np")
    assert out["uploaded_chunks"] == out["chunks"] > 0
    assert out["lookups"] == 0  # nothing of it was in the store: every chunk sent at once, in create mode
    return out["digest"]


def test_push_then_reboot_keeps_the_snapshot_ready(host_a, pushed):
    a = Controller(host_a.url, host_a.token)
    info = a.snapshot_info("np")
    assert info["stored"] == {"digest": pushed, "remote": True}
    before = a.spawn_sandboxes("np")[0]["id"]
    want = a.eval_code(before, "total")["result"]
    a.kill_sandbox(before)
    # a reboot: the server stops, tmpfs loses every RAM file, the server starts again
    root = mem_root(host_a)
    assert os.path.exists(os.path.join(root, "np", "memory.bin"))
    host_a.proc.send_signal(signal.SIGTERM)
    host_a.proc.wait(60)
    shutil.rmtree(root)
    host_a._start()
    host_a.wait_healthy()
    info = a.snapshot_info("np")
    assert info["status"] == "ready" and info["stored"]["digest"] == pushed
    kid = a.spawn_sandboxes("np")[0]["id"]
    assert os.path.exists(os.path.join(root, "np", "memory.bin"))  # written back on first use
    assert a.eval_code(kid, "total")["result"] == want
    assert a.eval_code(kid, "x + 1")["result"] == "42"
    a.kill_sandbox(kid)


def test_another_host_pulls_and_its_children_compute_the_same(host_a, host_b, pushed, s3):
    a, b = Controller(host_a.url, host_a.token), Controller(host_b.url, host_b.token)
    seen = []
    info = b.pull_snapshot("np", progress=lambda done, total: seen.append((done, total)))
    assert info["status"] == "ready" and info["stored"] == {"digest": pushed, "remote": True}
    assert info["pull"]["fetched_chunks"] == info["pull"]["chunks"]
    assert seen and seen[-1][0] == seen[-1][1]
    files = fetch_manifest(_s3(s3[0]), digest=pushed).files
    assert "memory.bin" in files and "devices.bin" in files
    for name in files:  # host B's files are host A's, byte for byte
        assert file_digest(snapshot_file(host_b, "np", name)) == file_digest(snapshot_file(host_a, "np", name)), name
    assert not any(n.endswith(".part") for n in os.listdir(os.path.dirname(snapshot_file(host_b, "np", "memory.bin"))))
    ref = a.spawn_sandboxes("np")[0]["id"]
    kids = [k["id"] for k in b.spawn_sandboxes("np", 2)]
    try:
        want = a.eval_code(ref, "repr(float(arr.sum()))")["result"]
        got = [b.eval_code(k, "repr(float(arr.sum()))")["result"] for k in kids]
        assert got == [want, want]
        draws = {b.eval_code(k, "np.random.rand()")["result"] for k in kids} | {a.eval_code(ref, "np.random.rand()")["result"]}
        assert len(draws) == 3  # each child reseeded: its own random numbers
    finally:
        a.kill_sandbox(ref)
        for k in kids:
            b.kill_sandbox(k)
    # pulling it again changes nothing and fetches nothing
    assert b.pull_snapshot("np")["stored"]["digest"] == pushed


def test_a_diff_branch_uploads_only_changed_chunks_and_each_chunk_moves_once(host_a, host_b, pushed, s3):
    env, log = s3
    a, b = Controller(host_a.url, host_a.token), Controller(host_b.url, host_b.token)
    kid = a.spawn_sandboxes("np")[0]["id"]
    a.run_code(kid, "arr[:200_000] = 2.0\ny = 'changed'")
    a.branch_sandbox(kid, "np-b", mode="diff")
    a.kill_sandbox(kid)
    out = a.push_snapshot("np-b")
    assert 0 < out["uploaded_chunks"] < out["chunks"] / 2, out
    puts = collections.Counter(p for m, p in log if m == "PUT" and "/chunks/" in p)
    assert puts and max(puts.values()) == 1  # no chunk uploaded twice across parent and branch
    # the chunks shared with the pushed parent were looked up (and not sent), the new ones sent at once
    assert out["lookups"] == out["chunks"] - out["uploaded_chunks"], out
    info = b.pull_snapshot("np-b")
    assert info["pull"]["fetched_chunks"] < info["pull"]["chunks"] / 2  # the parent's chunks were there
    gets = collections.Counter(p for m, p in log if m == "GET" and "/chunks/" in p)
    assert max(gets.values()) == 1  # every chunk fetched once, across both pulls
    kid = b.spawn_sandboxes("np-b")[0]["id"]
    assert b.eval_code(kid, "y")["result"] == "'changed'"
    assert b.eval_code(kid, "float(arr[:3].sum())")["result"] == "6.0"
    b.kill_sandbox(kid)


def _s3(env):
    from forkd_engine.store import RemoteStore
    return RemoteStore("s3://forkd/team", endpoint=env["AWS_ENDPOINT_URL"], access_key_id=env["AWS_ACCESS_KEY_ID"],
                       secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region="us-east-1", allow_http=True)


def test_a_tampered_chunk_fails_the_pull_naming_it_and_starts_nothing(s3, pushed):
    env, _log = s3
    remote = _s3(env)
    manifest = fetch_manifest(remote, digest=pushed)
    victim = manifest.files["memory.bin"]["chunks"][-1] or manifest.chunks()[-1]
    good = remote.get_chunk(victim)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    remote.delete(remote.chunk_path(victim))
    remote.put_chunk(victim, bytes(bad))
    try:
        with serving("--store", "s3://forkd/team", env=env) as c:
            status, body = call(c, "POST", "/v1/snapshots/pull", {"tag": "np"})
            assert status == 502, body
            assert victim in body["error"] and "s3://forkd/team" in body["error"] and body["chunk"] == victim
            ctl = Controller(c.url, c.token)
            assert ctl.list_snapshots() == [] and ctl.list_sandboxes() == []
            assert not os.listdir(os.path.join(c.data_dir, "vm", "snapshots"))
            assert not os.path.exists(os.path.join(mem_root(c), "np"))  # no RAM file, whole or partial
    finally:
        remote.delete(remote.chunk_path(victim))
        remote.put_chunk(victim, good)


def test_a_manifest_from_another_qemu_is_a_409_naming_the_field(host_b, s3, pushed):
    env, _log = s3
    from forkd_engine.store import Manifest
    remote = _s3(env)
    m = fetch_manifest(remote, digest=pushed)
    other = Manifest(files=m.files, requires=dict(m.requires, qemu="QEMU emulator version 1.0.0"),
                     meta=dict(m.meta, tag="np-old"))
    remote.put_manifest(other.digest[7:], other.to_bytes())
    status, body = call(host_b, "POST", "/v1/snapshots/pull", {"digest": other.digest})
    assert status == 409, body
    assert body["field"] == "qemu" and "QEMU emulator version 1.0.0" in body["error"]
    assert "np-old" not in {s["tag"] for s in Controller(host_b.url, host_b.token).list_snapshots()}


def test_an_unreachable_store_is_named_never_a_500_nor_the_secret():
    env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # nothing listens there
    with serving("--store", "s3://nowhere/x", env=env) as srv:
        status, body = call(srv, "POST", "/v1/snapshots/pull", {"tag": "np"})
        assert status == 502, body
        assert "s3://nowhere/x" in body["error"]
        assert S3_ENV["AWS_SECRET_ACCESS_KEY"] not in json.dumps(body)
        out = subprocess.run([*FORKD, "pull", "np", "--url", srv.url, "--token", srv.token],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode != 0 and "s3://nowhere/x" in out.stderr + out.stdout
        assert S3_ENV["AWS_SECRET_ACCESS_KEY"] not in srv.output()


def test_without_a_store_push_says_how_to_set_one(host_a):
    with serving() as srv:
        status, body = call(srv, "POST", "/v1/snapshots/pull", {"tag": "np"})
        assert status == 400 and "--store" in body["error"]
        status, body = call(srv, "POST", "/v1/snapshots/pull", {"tag": "a", "digest": "sha256:" + "0" * 64})
        assert status == 400


def test_the_magics_push_and_pull(host_a, host_b, pushed, capsys):
    from forkd_magics._magics import ForkdMagics
    a = ForkdMagics(controller=Controller(host_a.url, host_a.token))
    assert a.forkd("push np") == pushed
    assert "0 of" in capsys.readouterr().out  # every chunk was there already
    b = ForkdMagics(controller=Controller(host_b.url, host_b.token))
    snap = b.forkd(f"pull --digest {pushed}")
    said = capsys.readouterr().out  # fetched now, or by an earlier test of this module
    assert snap.tag == "np" and ("pulled np: " in said or "np is already on the server" in said), said


def test_the_cli_push_and_pull(host_a, host_b, pushed, s3):
    env = s3[0]
    out = subprocess.run([*FORKD, "push", "np", "--url", host_a.url, "--token", host_a.token, "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["digest"] == pushed
    out = subprocess.run([*FORKD, "pull", "--digest", pushed, "--url", host_b.url, "--token", host_b.token],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"np ({pushed}) is already on this server: nothing fetched" in out.stdout or \
        f"pulled np ({pushed}): ready" in out.stdout, out.stdout


def test_a_push_cut_short_resumes_when_the_server_starts_again(host_a, pushed, s3):
    """What a server killed mid-push leaves: some chunks in the store, no manifest update, and its
    marker. The next start says so and pushes what is missing."""
    env, _log = s3
    remote = _s3(env)
    victim = fetch_manifest(remote, digest=pushed).chunks()[0]
    remote.delete(remote.chunk_path(victim))
    host_a.proc.kill()  # kill -9, as a crash mid-push
    host_a.proc.wait(60)
    open(os.path.join(host_a.data_dir, "pushing", "np"), "w").close()
    host_a._start()
    host_a.wait_healthy()
    marker = os.path.join(host_a.data_dir, "pushing", "np")
    deadline = time.monotonic() + 120
    while os.path.exists(marker):  # the resumed push runs in the background; its end drops the marker
        assert time.monotonic() < deadline, host_a.output()
        time.sleep(0.2)
    assert remote.has_chunk(victim)
    assert "a push to s3://forkd/team was cut short" in host_a.output()


def test_the_async_sdk_pushes_and_pulls(host_a, host_b, pushed):
    import asyncio

    from forkd_server.client import AsyncController

    async def go():
        async with AsyncController(host_a.url, host_a.token) as a, AsyncController(host_b.url, host_b.token) as b:
            out = await a.push_snapshot("np")
            info = await b.pull_snapshot(digest=out["digest"])
            return out, info

    out, info = asyncio.run(go())
    assert out["digest"] == pushed and out["uploaded_chunks"] == 0
    assert info["tag"] == "np" and info["stored"]["digest"] == pushed
