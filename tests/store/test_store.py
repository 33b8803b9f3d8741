"""The chunk store on its own: chunking, manifests, the local cache, and push/pull against real
stores (a folder, memory, and moto's S3 server on loopback)."""

from __future__ import annotations

import collections
import hashlib
import os
import time

import pytest

from forkd_engine.store import (CHUNK_SIZE, ChunkCache, ChunkCorrupt, Incompatible, Manifest, NotInStore,
                                RemoteStore, StoreError, delete, fetch_manifest, materialise, persist, pull, push)
from forkd_engine.store import chunks as ck

from .s3 import S3_ENV, moto_s3

REQUIRES = {"qemu": "QEMU emulator version 7.2.0", "machine": "microvm", "accel": "tcg", "cpu": "max",
            "mem_mib": 64, "image": "abc"}


def write_ram(path: str, seed: int, n_chunks: int = 6, holes=(1,), zero=(2,), tail: int = 12345) -> None:
    """A RAM-like file: random chunks, a hole, an explicit all-zero chunk and a short tail."""
    rng = __import__("random").Random(seed)
    with open(path, "wb") as f:
        for i in range(n_chunks):
            if i in holes:
                f.seek(CHUNK_SIZE, 1)
            elif i in zero:
                f.write(bytes(CHUNK_SIZE))
            else:
                f.write(rng.randbytes(CHUNK_SIZE // 4) * 4)
        f.write(rng.randbytes(tail))


def files_of(tmp_path, name: str, seed: int) -> dict[str, str]:
    d = tmp_path / name
    d.mkdir()
    write_ram(str(d / "memory.bin"), seed)
    (d / "devices.bin").write_bytes(b"QEVM device state " * 100)
    return {"memory.bin": str(d / "memory.bin"), "devices.bin": str(d / "devices.bin")}


def test_persist_and_materialise_round_trip(tmp_path):
    cache = ChunkCache(str(tmp_path / "cache"))
    files = files_of(tmp_path, "a", 1)
    seen = []
    m = persist(cache, files, REQUIRES, {"tag": "a"}, progress=lambda done, total: seen.append((done, total)))
    mem = m.files["memory.bin"]
    assert mem["size"] == 6 * CHUNK_SIZE + 12345 and len(mem["chunks"]) == 7
    assert mem["chunks"][1] is None and mem["chunks"][2] is None  # the hole and the zero chunk
    assert m.digest.startswith("sha256:") and cache.get_manifest(m.digest).to_bytes() == m.to_bytes()
    assert seen and seen[-1][0] == seen[-1][1]
    out = tmp_path / "out"
    out.mkdir()
    materialise(cache, m, {n: str(out / n) for n in files})
    for name, path in files.items():
        assert (out / name).read_bytes() == open(path, "rb").read()
    # zero chunks come back as holes: less disk (or tmpfs RAM) than the file's size
    assert os.stat(out / "memory.bin").st_blocks * 512 < 6 * CHUNK_SIZE


def test_manifest_identity_and_requirements():
    m = Manifest(files={"memory.bin": {"size": 1, "chunks": ["0" * 64]}}, requires=REQUIRES, meta={"tag": "t"})
    assert Manifest.from_bytes(m.to_bytes()).digest == m.digest
    m.check(dict(REQUIRES))
    with pytest.raises(Incompatible) as err:
        m.check(dict(REQUIRES, qemu="QEMU emulator version 8.2.2"))
    assert err.value.field == "qemu" and "8.2.2" in str(err.value) and "7.2.0" in str(err.value)
    with pytest.raises(Incompatible) as err:
        m.check(dict(REQUIRES, accel="kvm"))
    assert err.value.field == "accel"


def test_tampered_local_chunk_fails_closed(tmp_path):
    cache = ChunkCache(str(tmp_path / "cache"))
    m = persist(cache, files_of(tmp_path, "a", 2), REQUIRES, {})
    victim = m.files["memory.bin"]["chunks"][0]
    raw = bytearray(open(cache.chunk_path(victim), "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(cache.chunk_path(victim), "wb").write(raw)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ChunkCorrupt) as err:
        materialise(cache, m, {"memory.bin": str(out / "memory.bin")})
    assert victim in str(err.value)
    assert not os.listdir(out)  # no partial file


def test_cache_evicts_lru_unpinned_only(tmp_path):
    cache = ChunkCache(str(tmp_path / "cache"), cap_bytes=0)
    keep = persist(cache, files_of(tmp_path, "a", 3), REQUIRES, {"tag": "a"})
    gone = persist(cache, files_of(tmp_path, "b", 4), REQUIRES, {"tag": "b"})
    cache.pin("a", keep.digest)
    assert cache.evict() == 0  # just written: a manifest may be about to pin them
    for hexd in set(gone.chunks()) | set(keep.chunks()):  # an hour later
        os.utime(cache.chunk_path(hexd), (time.time() - 3600, time.time() - 3600))
    assert cache.evict() > 0
    assert cache.has_all(keep)  # devices.bin is the same chunk in both: pinned through keep
    assert not any(cache.has(c) for c in set(gone.chunks()) - set(keep.chunks()))
    assert cache.get_manifest(gone.digest) is None and cache.usage()["unpinned_bytes"] == 0


def test_diff_branch_shares_unchanged_chunks(tmp_path):
    cache = ChunkCache(str(tmp_path / "cache"))
    parent_files = files_of(tmp_path, "p", 5)
    parent = persist(cache, parent_files, REQUIRES, {"tag": "p"})
    child_dir = tmp_path / "c"
    child_dir.mkdir()
    data = bytearray(open(parent_files["memory.bin"], "rb").read())
    data[3 * CHUNK_SIZE + 7] ^= 1  # one page changed in one chunk
    (child_dir / "memory.bin").write_bytes(data)
    child = persist(cache, {"memory.bin": str(child_dir / "memory.bin")}, REQUIRES, {"tag": "c"})
    shared = set(parent.chunks()) & set(child.chunks())
    assert len(shared) == len(child.chunks()) - 1


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_push_pull_through_obstore(tmp_path, kind):
    url = f"file://{tmp_path}/remote" if kind == "file" else "memory://"
    remote = RemoteStore(url)
    a = ChunkCache(str(tmp_path / "a"))
    m = persist(a, files_of(tmp_path, "src", 6), REQUIRES, {"tag": "t"})
    first = push(a, remote, m.digest, tag="t")
    assert first["uploaded_chunks"] == len(m.chunks())
    assert push(a, remote, m.digest, tag="t")["uploaded_chunks"] == 0  # nothing rewritten
    b = ChunkCache(str(tmp_path / "b"))
    got = fetch_manifest(remote, tag="t")
    assert got.digest == m.digest
    assert pull(b, remote, got)["fetched_chunks"] == len(m.chunks())
    assert pull(b, remote, got)["fetched_chunks"] == 0
    with pytest.raises(NotInStore, match="no snapshot tagged 'nope'"):
        fetch_manifest(remote, tag="nope")


def test_remote_delete_keeps_chunks_other_manifests_use(tmp_path):
    remote = RemoteStore(f"file://{tmp_path}/remote")
    cache = ChunkCache(str(tmp_path / "c"))
    a = persist(cache, files_of(tmp_path, "a", 7), REQUIRES, {"tag": "a"})
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    data = bytearray(open(tmp_path / "a" / "memory.bin", "rb").read())
    data[0] ^= 1
    (b_dir / "memory.bin").write_bytes(data)
    b = persist(cache, {"memory.bin": str(b_dir / "memory.bin")}, REQUIRES, {"tag": "b"})
    push(cache, remote, a.digest, tag="a")
    push(cache, remote, b.digest, tag="b")
    out = delete(remote, a.digest, grace_seconds=0)
    assert out["removed_chunks"] == len(set(a.chunks()) - set(b.chunks()))
    fresh = ChunkCache(str(tmp_path / "fresh"))
    pull(fresh, remote, fetch_manifest(remote, tag="b"))
    assert fresh.has_all(b)
    with pytest.raises(NotInStore):
        fetch_manifest(remote, tag="a")


def test_remote_delete_counts_the_young_chunks_it_leaves(tmp_path):
    """Chunks no manifest lists but younger than the grace period stay (a push may be writing them);
    the answer says how many, so '0 removed, 0 kept' does not hide a store that still holds them."""
    remote = RemoteStore(f"file://{tmp_path}/remote")
    cache = ChunkCache(str(tmp_path / "c"))
    a = persist(cache, files_of(tmp_path, "a", 7), REQUIRES, {"tag": "a"})
    push(cache, remote, a.digest, tag="a")
    out = delete(remote, a.digest)  # the default grace: an hour
    assert (out["removed_chunks"], out["kept_chunks"], out["waiting_chunks"]) == (0, 0, len(set(a.chunks())))
    assert len(remote.list("chunks/")) == len(set(a.chunks()))


def test_s3_push_pull_and_tamper(tmp_path, monkeypatch):
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    with moto_s3() as (endpoint, log):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        remote = RemoteStore("s3://forkd/team")
        a = ChunkCache(str(tmp_path / "a"))
        m = persist(a, files_of(tmp_path, "src", 8), REQUIRES, {"tag": "t"})
        push(a, remote, m.digest, tag="t")
        puts = [p for meth, p in log if meth == "PUT" and "/chunks/" in p]
        assert sorted(puts) == sorted(f"/forkd/team/chunks/{c[:2]}/{c}" for c in m.chunks())
        victim = m.chunks()[1]
        blob = bytearray(remote.get_chunk(victim))
        blob[-5] ^= 0x40
        remote.delete(remote.chunk_path(victim))
        remote.put_chunk(victim, bytes(blob))
        b = ChunkCache(str(tmp_path / "b"))
        with pytest.raises(ChunkCorrupt) as err:
            pull(b, remote, fetch_manifest(remote, tag="t"))
        assert victim in str(err.value) and "s3://forkd/team" in str(err.value)
        assert not b.has(victim)


def test_a_push_looks_up_only_the_chunks_the_store_is_believed_to_hold(tmp_path, monkeypatch):
    """A lookup before each send only spares sending what the store holds: a first push sends every
    chunk at once (create mode); chunks given as held are looked up first; a push that finds a chunk
    there already looks up the rest; a resumed push looks up all. moto's log counts the requests."""
    from forkd_engine.store.transfer import IO_WORKERS
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    n = 3 * IO_WORKERS
    src = tmp_path / "many.bin"
    with open(src, "wb") as f:
        for i in range(n):  # distinct non-zero chunks that compress to almost nothing
            f.write(bytes([i + 1]) * CHUNK_SIZE)
    cache = ChunkCache(str(tmp_path / "c"))
    a = persist(cache, {"memory.bin": str(src)}, REQUIRES, {"tag": "a"})
    data = bytearray(src.read_bytes())
    data[5 * CHUNK_SIZE] ^= 0xFF  # one chunk changed
    (tmp_path / "b.bin").write_bytes(data)
    b = persist(cache, {"memory.bin": str(tmp_path / "b.bin")}, REQUIRES, {"tag": "b"})
    assert len(a.chunks()) == n and len(set(b.chunks()) - set(a.chunks())) == 1

    def requests(log, since, method):
        return [p for m, p in log[since:] if m == method and "/chunks/" in p]

    with moto_s3() as (endpoint, log):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        remote = RemoteStore("s3://forkd/looks")
        mark = len(log)
        first = push(cache, remote, a.digest, tag="a")
        assert (first["uploaded_chunks"], first["lookups"]) == (n, 0)
        assert requests(log, mark, "HEAD") == [] and len(requests(log, mark, "PUT")) == n

        mark = len(log)
        branch = push(cache, remote, b.digest, tag="b", held=set(a.chunks()))
        new = (set(b.chunks()) - set(a.chunks())).pop()
        assert branch["uploaded_chunks"] == 1 and branch["lookups"] == n - 1
        assert requests(log, mark, "PUT") == [f"/forkd/looks/chunks/{new[:2]}/{new}"]  # nothing sent twice

        mark = len(log)
        again = push(cache, remote, a.digest)  # nothing believed held, all there: sends stop at the first refusal
        assert again["uploaded_chunks"] == 0
        assert len(requests(log, mark, "PUT")) <= IO_WORKERS < n
        assert again["lookups"] >= n - IO_WORKERS

        mark = len(log)
        resumed = push(cache, remote, a.digest, look_first=True)
        assert (resumed["uploaded_chunks"], resumed["lookups"]) == (0, n)
        assert requests(log, mark, "PUT") == []


def test_unreachable_and_denied_stores_are_named_without_secret(tmp_path, monkeypatch):
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    remote = RemoteStore("s3://forkd/x")
    with pytest.raises(StoreError) as err:
        remote.get_tag("t")
    text = str(err.value)
    assert "s3://forkd/x" in text and S3_ENV["AWS_SECRET_ACCESS_KEY"] not in text and "Debug" not in text
    with pytest.raises(StoreError, match="unknown scheme"):
        RemoteStore("ftp://host/x")
    with pytest.raises(StoreError, match="no credentials"):
        RemoteStore("s3://key:secret@bucket/x")


@pytest.mark.parametrize("url, said", [("s3:/bucket", "names no bucket: use s3://BUCKET/prefix"),
                                        ("gs://", "names no bucket"),
                                        ("file://srv/store", "absolute path after three slashes"),
                                        ("file:relative", "absolute path after three slashes")])
def test_a_store_url_that_names_no_store_is_refused_before_it_is_opened(url, said):
    with pytest.raises(StoreError, match=said):
        RemoteStore(url)


def test_two_hosts_pushing_the_same_snapshot_at_once_make_one_manifest(tmp_path, monkeypatch):
    import threading
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    with moto_s3() as (endpoint, log):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        files = files_of(tmp_path, "src", 9)
        hosts = [ChunkCache(str(tmp_path / f"h{i}")) for i in range(2)]
        digests = [persist(h, files, REQUIRES, {"tag": "t"}).digest for h in hosts]
        assert digests[0] == digests[1]  # the same files make the same snapshot identity on any host
        results, errors = [], []

        def one(host):
            try:
                results.append(push(host, RemoteStore("s3://forkd/race"), digests[0], tag="t"))
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(h,)) for h in hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(results) == 2
        remote = RemoteStore("s3://forkd/race")
        assert [m["path"] for m in remote.list("manifests/")] == [f"manifests/{digests[0][7:]}"]
        chunks = {m["path"] for m in remote.list("chunks/")}
        assert len(chunks) == len(Manifest.from_bytes(remote.get_manifest(digests[0][7:])).chunks())
        # every chunk was written once: the loser of a race finds it there (412) and rewrites nothing
        assert sum(r["uploaded_chunks"] for r in results) == len(chunks)


def test_a_store_that_denies_access_is_named_with_its_reason(tmp_path, monkeypatch):
    from moto import settings
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    with moto_s3() as (endpoint, _log):
        monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks credentials from now on
        remote = RemoteStore("s3://forkd/x", endpoint=endpoint, allow_http=True)
        with pytest.raises(StoreError) as err:
            remote.get_tag("t")
        text = str(err.value)
        assert text.startswith("store s3://forkd/x: reading tags/t: access denied") and "InvalidAccessKeyId" in text
        assert "<?xml" not in text and S3_ENV["AWS_SECRET_ACCESS_KEY"] not in text


def test_a_branch_keeps_a_chunk_changed_in_a_few_pages_as_a_page_patch(tmp_path):
    cache = ChunkCache(str(tmp_path / "cache"))
    parent_files = files_of(tmp_path, "p", 10)
    parent = persist(cache, parent_files, REQUIRES, {"tag": "p"})
    data = bytearray(open(parent_files["memory.bin"], "rb").read())
    data[3 * CHUNK_SIZE + 5000] ^= 1                   # one page of chunk 3
    data[4 * CHUNK_SIZE:5 * CHUNK_SIZE] = os.urandom(CHUNK_SIZE)  # all of chunk 4
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "memory.bin").write_bytes(data)
    child = persist(cache, {"memory.bin": str(tmp_path / "c" / "memory.bin")}, REQUIRES, {"tag": "c"}, parent=parent)
    entries = child.files["memory.bin"]["chunks"]
    patch = entries[3]
    assert isinstance(patch, dict) and patch["base"] == parent.files["memory.bin"]["chunks"][3]
    assert patch["patch_size"] == 128 + 4096                  # the page bitmap and one page
    assert patch["xor"] is True and cache.size(patch["patch"]) < 300  # XORed: a page of zeros but one bit
    assert isinstance(entries[4], str)                         # more than half changed: kept whole
    assert entries[0] == parent.files["memory.bin"]["chunks"][0]
    new = set(child.chunks()) - set(parent.chunks())
    assert new == {patch["patch"], entries[4]}
    # the branch comes back whole, here and on another host
    remote = RemoteStore(f"file://{tmp_path}/remote")
    push(cache, remote, parent.digest)
    push(cache, remote, child.digest)
    other = ChunkCache(str(tmp_path / "other"))
    pull(other, remote, fetch_manifest(remote, digest=child.digest))
    out = tmp_path / "out"
    out.mkdir()
    materialise(other, child, {"memory.bin": str(out / "memory.bin")})
    assert (out / "memory.bin").read_bytes() == bytes(data)
    # a patch that fails its check stops the write, naming it
    blob = bytearray(open(other.chunk_path(patch["patch"]), "rb").read())
    blob[-3] ^= 0xFF
    open(other.chunk_path(patch["patch"]), "wb").write(blob)
    with pytest.raises(ChunkCorrupt, match=patch["patch"]):
        materialise(other, child, {"memory.bin": str(out / "again.bin")})


def test_a_page_patch_whose_pages_replace_the_base_s_still_applies(tmp_path):
    """Manifests written before page patches were XORed name patches of plain pages (no ``xor``)."""
    cache = ChunkCache(str(tmp_path / "cache"))
    base = os.urandom(CHUNK_SIZE)
    data = bytearray(base)
    data[7 * 4096:8 * 4096] = os.urandom(4096)
    plain = bytearray(CHUNK_SIZE // 4096 // 8)
    plain[0] = 1 << 7
    plain += data[7 * 4096:8 * 4096]
    for blob in (base, bytes(plain)):
        cache.write(ck.digest(blob), ck.compress(blob))
    entry = {"sha256": ck.digest(bytes(data)), "base": ck.digest(base), "patch": ck.digest(bytes(plain)),
             "patch_size": len(plain)}
    old = Manifest(files={"memory.bin": {"size": CHUNK_SIZE, "chunks": [entry]}}, requires=REQUIRES)
    materialise(cache, old, {"memory.bin": str(tmp_path / "old.bin")})
    assert (tmp_path / "old.bin").read_bytes() == bytes(data)
    # read as XORed pages, the same patch makes another chunk: its check stops it
    xored = Manifest(files={"memory.bin": {"size": CHUNK_SIZE, "chunks": [{**entry, "xor": True}]}}, requires=REQUIRES)
    with pytest.raises(ChunkCorrupt, match=entry["patch"]):
        materialise(cache, xored, {"memory.bin": str(tmp_path / "xored.bin")})
    assert not (tmp_path / "xored.bin").exists() and not (tmp_path / "xored.bin.part").exists()


def _counting_decompress(monkeypatch) -> collections.Counter:
    """Count how often each stored object is decompressed (by its compressed bytes' sha256)."""

    seen, real = collections.Counter(), ck.decompress

    def counted(blob, size):
        seen[hashlib.sha256(blob).hexdigest()] += 1
        return real(blob, size)

    monkeypatch.setattr(ck, "decompress", counted)
    return seen


def test_a_pull_writes_the_files_in_one_pass_identical_to_the_source(tmp_path, monkeypatch):
    cache = ChunkCache(str(tmp_path / "src-cache"))
    parent_files = files_of(tmp_path, "p", 11)
    parent = persist(cache, parent_files, REQUIRES, {"tag": "p"})
    data = bytearray(open(parent_files["memory.bin"], "rb").read())
    data[3 * CHUNK_SIZE + 9000] ^= 1  # a page patch against the parent's chunk
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "memory.bin").write_bytes(data)
    (tmp_path / "c" / "devices.bin").write_bytes(open(parent_files["devices.bin"], "rb").read())
    child_files = {n: str(tmp_path / "c" / n) for n in ("memory.bin", "devices.bin")}
    child = persist(cache, child_files, REQUIRES, {"tag": "c"}, parent=parent)
    assert any(isinstance(e, dict) for e in child.files["memory.bin"]["chunks"])
    remote = RemoteStore(f"file://{tmp_path}/remote")
    push(cache, remote, parent.digest)
    push(cache, remote, child.digest)
    # another host, holding nothing: one pass writes the files, each object decompressed once
    other = ChunkCache(str(tmp_path / "other"))
    out = tmp_path / "out"
    out.mkdir()
    seen = _counting_decompress(monkeypatch)
    progress = []
    figures = materialise(other, child, {n: str(out / n) for n in child.files}, remote=remote,
                          progress=lambda done, total: progress.append((done, total)))
    assert figures["fetched_chunks"] == figures["chunks"] == len(child.chunks())
    assert sorted(seen.values()) == [1] * len(child.chunks())
    assert progress and progress[-1][0] == progress[-1][1]
    for name, path in child_files.items():
        assert (out / name).read_bytes() == open(path, "rb").read()
    assert sorted(os.listdir(out)) == ["devices.bin", "memory.bin"]  # no .part left
    assert os.stat(out / "memory.bin").st_blocks * 512 < 6 * CHUNK_SIZE  # zero chunks stay holes
    # the local store keeps what it fetched, compressed: a push from here needs nothing from elsewhere
    assert other.has_all(child) and other.get_manifest(child.digest) is not None
    again = RemoteStore(f"file://{tmp_path}/again")
    assert push(other, again, child.digest)["uploaded_chunks"] == len(child.chunks())
    # a second write of the same files fetches nothing
    (out / "memory.bin").unlink()
    assert materialise(other, child, {"memory.bin": str(out / "memory.bin")}, remote=remote)["fetched_chunks"] == 0
    assert (out / "memory.bin").read_bytes() == bytes(data)


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_tampered_chunk_on_pull_leaves_no_files_and_no_snapshot(tmp_path, which):
    cache = ChunkCache(str(tmp_path / "src-cache"))
    m = persist(cache, files_of(tmp_path, "src", 12), REQUIRES, {"tag": "t"})
    remote = RemoteStore(f"file://{tmp_path}/remote")
    push(cache, remote, m.digest, tag="t")
    victims = [c for c in m.files["memory.bin"]["chunks"] if c]
    victim = victims[0] if which == "first" else victims[-1]
    blob = bytearray(remote.get_chunk(victim))
    blob[len(blob) // 2] ^= 0x10
    remote.delete(remote.chunk_path(victim))
    remote.put_chunk(victim, bytes(blob))
    other = ChunkCache(str(tmp_path / "other"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ChunkCorrupt) as err:
        materialise(other, m, {n: str(out / n) for n in m.files}, remote=remote)
    assert err.value.chunk == victim and f"file://{tmp_path}/remote" in str(err.value)
    assert os.listdir(out) == []                      # no file, whole or partial
    assert not other.has(victim)                       # the bad chunk is not kept
    assert other.get_manifest(m.digest) is None        # nothing recorded as complete
