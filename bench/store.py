"""Benchmark of the snapshot store: what a VM snapshot costs to keep and to move.

    python3 bench/store.py              # a summary
    python3 bench/store.py --json       # one JSON object
    python3 bench/store.py --mem 512 --numpy-mb 100 --changed 0.1 --reps 3

Drives the VM engine (TCG here) and the store directly, with moto's S3 server on loopback as the
remote store. Figures:
- stored_bytes / guest_ram_bytes: a snapshot of a guest with ``--numpy-mb`` MB of random float64s
  (incompressible: the worst case) in its local store: compressed chunks, zero chunks not stored;
  also persist_ms (chunk, hash, compress into the local store).
- diff_upload_ratio: a diff branch of a child that rewrote ``--changed`` of guest RAM (in the
  array), pushed after its parent: its bytes uploaded / the parent's bytes uploaded; beside it
  diff_upload_over_ram (the same bytes / guest RAM) and diff_floor_ratio (the rewritten bytes
  themselves, random and so incompressible, / the parent's bytes uploaded) and
  diff_floor_compressed_ratio (those bytes zstd-compressed in 4 MiB chunks / the parent's): no
  store of chunks and page patches goes below that floor. ``bench/store_diff.py`` breaks the diff
  down chunk by chunk.
- push_mb_s / pull_mb_s: the parent's stored (compressed) bytes over the time of a push to an empty
  bucket (push_looking_first_mb_s: the same push with a lookup before every chunk, as a resumed push
  makes; push_lookups / diff_lookups: the lookups of the parent's and the branch's push), and of a
  pull into an empty local store (fetch + verify every chunk + write); beside them
  the same bytes through plain obstore (the chunks put / got as objects, in parallel as ours, without
  hashing or compression): baseline_put_mb_s, baseline_get_mb_s, and the ratios. Medians of
  ``--reps`` interleaved runs (each its own bucket and store). push_content_mb_s and
  pull_content_mb_s count the snapshot's own bytes instead (its non-zero chunks uncompressed,
  content_mb): what a host gains per second.
- pull_to_files: a pull that makes the snapshot's files on a host holding none of its chunks (into
  a fresh local store, memory.bin into tmpfs), both ways in alternating order each repetition:
  one_pass (each chunk fetched, verified once, written into its file and kept: the pull) and
  two_pass (every chunk pulled into the local store, then the files written from it, every chunk
  verified again: the pull before it was one pass); medians, their MB/s of compressed chunks and
  of content, and the median of the paired ratios one_pass / two_pass.
- wake_from_local_store: a snapshot whose RAM file tmpfs lost, spawned again: materialise_ms
  (decompress + verify + write memory.bin into tmpfs; nothing to fetch from the local store) and
  restore_ms (QEMU's restore until the agent confirms), as a stored notebook's wake would do.
- tiers: a sandbox of the same kind of guest moved by the controller's tiers (forkd_server/controller/tiers.py,
  as ``POST /v1/sandboxes/{id}/freeze``, ``/store`` and ``/wake`` do), medians of ``--reps``:
  frozen_wake_ms (frozen -> running: QMP ``cont``), store_ms (branch into the local store, QEMU
  ended, RAM file freed) and the wake of a stored sandbox from the local store with its split:
  fetch_ms (chunks the local store lacks: none here), decompress_ms (memory.bin written back) and
  restore_ms (a VM restored under the same id), total_ms; eval_after_wake checks the state.
- wake_from_remote_store: the same kind of sandbox stored into moto, the chunks of its state
  deleted from the local store, then woken (``--reps`` times): the split the wake reports. The
  wake fetches, verifies and writes each chunk into the RAM file in one pass, so ``fetch_ms`` and
  ``decompress_ms`` divide that pass's wall time by the time its threads spent on each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

import obstore  # noqa: E402

from forkd_engine import ChildSpec, SnapshotSpec  # noqa: E402
from forkd_engine.store import ChunkCache, RemoteStore, materialise, pull, push  # noqa: E402
from forkd_engine.store import chunks as ck  # noqa: E402
from forkd_engine.store.transfer import IO_WORKERS  # noqa: E402
from forkd_engine.vm import VMEngine  # noqa: E402
from forkd_engine.vm import durable  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from forkd_server.controller import Controller  # noqa: E402


def ms(t0: float) -> float:
    return round((time.monotonic() - t0) * 1000, 1)


def med(values):
    return round(statistics.median(values), 1)


def run(engine, h, code, timeout=600):
    reply = engine.call(h, {"action": "run_code", "code": code}, timeout=timeout)
    if reply.get("error"):
        raise RuntimeError(reply["error"])
    return reply


def rewritten_compressed(n: int, rewrite: int) -> int:
    """The bytes the diff branch's child wrote (the guest's generator, reproduced here), compressed
    in chunks as the store does: what no store of whole or patched chunks goes below."""
    import numpy as np

    new = (np.random.default_rng(1).random(n)[:rewrite] + 1.0).tobytes()
    return sum(len(ck.compress(new[i:i + ck.CHUNK_SIZE])) for i in range(0, len(new), ck.CHUNK_SIZE))


def pull_to_files(way: str, remote, manifest, root: str, mem_dir: str) -> float:
    """Seconds to make a snapshot's files on a host that holds none of its chunks: ``two_pass`` pulls
    every chunk into a fresh local store (each verified) and then writes the files from it (each
    verified again); ``one_pass`` writes each chunk into its file as it verifies it, keeping it in the
    store too (what a pull does). ``memory.bin`` goes to tmpfs, as the VM engine's does."""
    cache = ChunkCache(os.path.join(root, "store"))
    os.makedirs(mem_dir, exist_ok=True)
    dests = {n: os.path.join(mem_dir if n == "memory.bin" else root, n) for n in manifest.files}
    t0 = time.monotonic()
    if way == "two_pass":
        pull(cache, remote, manifest)
        materialise(cache, manifest, dests)
    else:
        materialise(cache, manifest, dests, remote=remote)
    took = time.monotonic() - t0
    shutil.rmtree(root)
    shutil.rmtree(mem_dir)
    return took


def moto_process() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a process of its own (as a real store is: its work shares no GIL with
    ours), on a free loopback port; returned once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1).read()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto's server did not start") from None
            time.sleep(0.1)


def bucket(endpoint: str, name: str) -> RemoteStore:
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{name}", method="PUT")).read()
    return RemoteStore(f"s3://{name}/bench", endpoint=endpoint, access_key_id="bench", secret_access_key="bench",
                       region="us-east-1", allow_http=True)


def baseline(remote: RemoteStore, blobs: list[bytes]) -> tuple[float, float]:
    """Seconds to put, then get, the same blobs as plain objects with as many threads as ours."""
    paths = [f"plain/{i}" for i in range(len(blobs))]
    with ThreadPoolExecutor(IO_WORKERS) as pool:
        t0 = time.monotonic()
        list(pool.map(lambda pb: obstore.put(remote.store, pb[0], pb[1]), zip(paths, blobs)))
        put_s = time.monotonic() - t0
        t0 = time.monotonic()
        list(pool.map(lambda p: bytes(obstore.get(remote.store, p).bytes()), paths))
        get_s = time.monotonic() - t0
    return put_s, get_s


def tiers(engine: VMEngine, data_dir: str, args, setup: str) -> dict:
    """A sandbox frozen and woken, then stored and woken, ``--reps`` times each, through the
    controller's tiers (the REST routes' code), on a guest like the parent's."""
    ctl = Controller(data_dir, engines={"vm": engine})
    try:
        ctl.create_snapshot("nb", engine="vm", mem_size_mib=args.mem, packages=["python3-numpy"],
                            setup=setup + "x = 21\n", setup_timeout_secs=900)
        ctl.stores.wait_idle(900)  # its durable copy is written first: nothing else runs while we measure
        sb = ctl.spawn("nb")[0]["id"]
        frozen, stored, store_ms = [], [], []
        for _ in range(args.reps):
            ctl.freeze_sandbox(sb)
            frozen.append(ctl.wake_sandbox(sb)["wake"]["ms"])
            t0 = time.monotonic()
            ctl.store_sandbox(sb)
            store_ms.append(ms(t0))
            stored.append(ctl.wake_sandbox(sb)["wake"])
        state = ctl.eval(sb, "(x, float(arr[:3].sum()) > 0)")["result"]
        ctl.kill_sandbox(sb)
        ctl.delete_snapshot("nb")
        return {"frozen_wake_ms": med(frozen), "target_frozen_wake_ms": "<= 50", "store_ms": med(store_ms),
                "stored_wake": {**{k: med([w[k] for w in stored]) for k in ("fetch_ms", "decompress_ms", "restore_ms")},
                                "total_ms": med([w["ms"] for w in stored])},
                "target_stored_wake_ms": "<= 2000", "reps": args.reps, "eval_after_wake": state}
    finally:
        ctl.stores.close()
        ctl.registry.close()


def remote_wakes(engine: VMEngine, data_dir: str, args, setup: str, endpoint: str) -> dict:
    """A stored sandbox woken from the remote store (moto) after this host's local store lost every
    chunk of its state (as a host that holds none of them; those it shares with the snapshot it came
    from are put back after the wake), ``--reps`` times, through the controller's tiers: the wake's
    split as it reports it."""
    bucket(endpoint, "wake")
    ctl = Controller(data_dir, engines={"vm": engine}, store="s3://wake/bench",
                     store_options={"endpoint": endpoint, "access_key_id": "bench", "secret_access_key": "bench",
                                    "region": "us-east-1", "allow_http": True})
    try:
        ctl.create_snapshot("nbr", engine="vm", mem_size_mib=args.mem, packages=["python3-numpy"],
                            setup=setup + "x = 21\n", setup_timeout_secs=900)
        ctl.stores.wait_idle(900)
        sb = ctl.spawn("nbr")[0]["id"]
        woke = []
        for _ in range(args.reps):
            ctl.store_sandbox(sb)
            stored = ctl.registry.get_sandbox(sb)["stored"]
            store = engine.store
            others = set().union(*(store.get_manifest(d).chunks() for name, d in store.pins().items()
                                   if name != stored["handle"]["tag"] and store.get_manifest(d)))
            aside = os.path.join(data_dir, "aside")
            os.makedirs(aside, exist_ok=True)
            for chunk in store.get_manifest(stored["digest"]).chunks():  # all of them
                if chunk in others:  # back after the wake: a branch of the sandbox reuses its parent's
                    os.rename(store.chunk_path(chunk), os.path.join(aside, chunk))
                else:
                    os.unlink(store.chunk_path(chunk))
            woke.append(ctl.wake_sandbox(sb)["wake"])
            for chunk in os.listdir(aside):
                if store.has(chunk):
                    os.unlink(os.path.join(aside, chunk))
                else:
                    os.rename(os.path.join(aside, chunk), store.chunk_path(chunk))
            ctl.stores.stored_copies.wait_idle(120)
        state = ctl.eval(sb, "(x, float(arr[:3].sum()) > 0)")["result"]
        ctl.kill_sandbox(sb)
        ctl.delete_snapshot("nbr")
        return {**{k: med([w[k] for w in woke]) for k in ("fetch_ms", "decompress_ms", "restore_ms", "ms")},
                "fetched_mb": round(statistics.median(w["fetched_bytes"] for w in woke) / 1e6, 1),
                "reps": args.reps, "eval_after_wake": state}
    finally:
        ctl.stores.close()
        ctl.registry.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mem", type=int, default=512, help="guest RAM, MiB")
    ap.add_argument("--numpy-mb", type=int, default=100)
    ap.add_argument("--changed", type=float, default=0.10, help="fraction of guest RAM the diff branch rewrites")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=["tiers", "store", "remote_wake"],
                    help="only the tiers' figures (freeze, store, wake), only the others, or only the wake "
                         "from the remote store")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fkstore")
    server, endpoint = moto_process()
    engine = VMEngine(os.path.join(root, "vm"))
    out: dict = {"guest_ram_mib": args.mem, "numpy_mb": args.numpy_mb, "accel": engine.accel}
    handles = []
    try:
        n = args.numpy_mb * 1_000_000 // 8
        setup = f"import numpy as np\narr = np.random.default_rng(1).random({n})\n"
        if args.only in (None, "remote_wake"):
            out["wake_from_remote_store"] = remote_wakes(engine, os.path.join(root, "ctl-remote"), args, setup,
                                                         endpoint)
        if args.only in (None, "store"):
            parent = engine.create_snapshot(SnapshotSpec(tag="parent", mem_size_mib=args.mem, packages=["python3-numpy"],
                                                         setup=setup, setup_timeout=900))
            handles.append(parent)
            t0 = time.monotonic()
            digest = engine.store_snapshot(parent)
            out["persist_ms"] = ms(t0)
            manifest = engine.store.get_manifest(digest)
            stored = manifest.stored_bytes({c: engine.store.size(c) for c in manifest.chunks()})
            ram = args.mem << 20
            zero = sum(c is None for c in manifest.files["memory.bin"]["chunks"])
            out.update(stored_bytes=stored, guest_ram_bytes=ram, stored_over_ram=round(stored / ram, 3),
                       memory_chunks=len(manifest.files["memory.bin"]["chunks"]), zero_chunks_not_stored=zero,
                       target_stored_over_ram="<= 0.5")

            # a diff branch that rewrote a fraction of guest RAM (in the array: what a notebook does)
            kid = engine.spawn(parent, [ChildSpec(id="kid", lineage=["parent", "kid"])])[0]
            handles.append(kid)
            rewrite = int(args.changed * ram) // 8
            run(engine, kid, f"arr[:{min(rewrite, n)}] += 1.0")
            result = engine.branch(kid, "branch", ["parent", "kid", "branch"], mode="diff")
            child = result.ready.result(timeout=600)
            handles.append(child)
            engine.kill(kid)
            handles.remove(kid)
            child_digest = engine.store_snapshot(child)

            # push / pull against moto, interleaved with plain obstore on the same bytes
            blobs = [engine.store.read(c) for c in manifest.chunks()]
            moved = sum(map(len, blobs))
            push_s, pull_s, put_s, get_s, looked_s = [], [], [], [], []
            files_s: dict[str, list[float]] = {"one_pass": [], "two_pass": []}
            for rep in range(args.reps):
                remote = bucket(endpoint, f"bench-{rep}")
                t0 = time.monotonic()
                first = push(engine.store, remote, digest, tag="parent")
                push_s.append(time.monotonic() - t0)
                # the same push with a lookup before every chunk (as every push did before 2026-11-27)
                t0 = time.monotonic()
                push(engine.store, bucket(endpoint, f"bench-look-{rep}"), digest, tag="parent", look_first=True)
                looked_s.append(time.monotonic() - t0)
                if rep == 0:
                    # the parent is in the store: the server believes its chunks held (held_remotely)
                    second = push(engine.store, remote, child_digest, tag="branch", held=set(manifest.chunks()))
                    out.update(parent_uploaded_bytes=first["uploaded_bytes"], diff_uploaded_bytes=second["uploaded_bytes"],
                               push_lookups=first["lookups"], diff_lookups=second["lookups"],
                               diff_uploaded_chunks=second["uploaded_chunks"], diff_chunks=second["chunks"],
                               diff_upload_ratio=round(second["uploaded_bytes"] / first["uploaded_bytes"], 3),
                               diff_upload_over_ram=round(second["uploaded_bytes"] / ram, 3),
                               diff_floor_ratio=round(min(rewrite, n) * 8 / first["uploaded_bytes"], 3),
                               diff_floor_compressed_ratio=round(rewritten_compressed(n, min(rewrite, n))
                                                                 / first["uploaded_bytes"], 3),
                               target_diff_upload_ratio="<= 0.15")
                fresh = ChunkCache(os.path.join(root, f"pull{rep}"))
                t0 = time.monotonic()
                pull(fresh, remote, manifest)
                pull_s.append(time.monotonic() - t0)
                shutil.rmtree(fresh.root)
                # a whole pull into the snapshot's files, both ways, in alternating order
                for way in (("one_pass", "two_pass") if rep % 2 else ("two_pass", "one_pass")):
                    files_s[way].append(pull_to_files(way, remote, manifest, os.path.join(root, f"files{rep}"),
                                                      os.path.join(engine.mem_root, f"bench-pull{rep}")))
                p, g = baseline(remote, blobs)
                put_s.append(p)
                get_s.append(g)
            mb = moved / 1e6
            content = sum(min(manifest.chunk_size, e["size"] - i * manifest.chunk_size)
                          for e in manifest.files.values() for i, c in enumerate(e["chunks"]) if c is not None) / 1e6
            out.update(content_mb=round(content, 1), push_content_mb_s=med([content / s for s in push_s]),
                       pull_content_mb_s=med([content / s for s in pull_s]))
            out.update(moved_mb=round(mb, 1), reps=args.reps,
                       push_mb_s=med([mb / s for s in push_s]), baseline_put_mb_s=med([mb / s for s in put_s]),
                       push_looking_first_mb_s=med([mb / s for s in looked_s]),
                       pull_mb_s=med([mb / s for s in pull_s]), baseline_get_mb_s=med([mb / s for s in get_s]),
                       target_mb_s=">= 200")
            out["push_over_baseline"] = round(out["push_mb_s"] / out["baseline_put_mb_s"], 2)
            out["pull_over_baseline"] = round(out["pull_mb_s"] / out["baseline_get_mb_s"], 2)
            out["pull_to_files"] = {
                "one_pass_ms": med([s * 1000 for s in files_s["one_pass"]]),
                "two_pass_ms": med([s * 1000 for s in files_s["two_pass"]]),
                "one_pass_mb_s": med([mb / s for s in files_s["one_pass"]]),
                "two_pass_mb_s": med([mb / s for s in files_s["two_pass"]]),
                "one_pass_content_mb_s": med([content / s for s in files_s["one_pass"]]),
                "paired_ratio": round(statistics.median([a / b for a, b in zip(files_s["one_pass"],
                                                                               files_s["two_pass"])]), 3)}
            out["pull_to_files"]["one_pass_over_baseline_get"] = round(
                out["pull_to_files"]["one_pass_mb_s"] / out["baseline_get_mb_s"], 2)

            # wake from the local store: the RAM file gone (a reboot), written back, then restored
            wake = {"materialise_ms": [], "restore_ms": []}
            for rep in range(args.reps):
                # as a stored snapshot's RAM file is freed: its pre-started QEMUs go first (one
                # started against a missing file would map a new, empty one)
                assert engine.release_files(parent)
                t0 = time.monotonic()
                durable.ensure_files(engine, parent)
                wake["materialise_ms"].append(ms(t0))
                t0 = time.monotonic()
                h = engine.spawn(parent, [ChildSpec(id=f"wake{rep}", lineage=["parent", f"wake{rep}"])])[0]
                wake["restore_ms"].append(ms(t0))
                engine.kill(h)
            out["wake_from_local_store"] = {"fetch_ms": 0.0, "materialise_ms": med(wake["materialise_ms"]),
                                            "restore_ms": med(wake["restore_ms"]),
                                            "total_ms": med([a + b for a, b in zip(wake["materialise_ms"], wake["restore_ms"])]),
                                            "target_ms": "<= 2000"}

        if args.only in (None, "tiers"):
            out["tiers"] = tiers(engine, os.path.join(root, "ctl"), args, setup)
    finally:
        for h in handles:
            (engine.kill if h.get("kind") == "vm" else engine.delete_snapshot)(h)
        engine.close()
        server.terminate()
        server.wait()
        shutil.rmtree(engine.mem_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
