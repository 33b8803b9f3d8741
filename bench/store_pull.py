"""Where a store pull's time goes: the pull against a plain get of the same objects, and the pull's
steps timed per chunk. No VM: a snapshot-like file (random chunks as numpy's floats, half-zero
chunks, all-zero chunks) is chunked into a local store and pushed to moto's S3 server (a process of
its own, on loopback), as bench/store.py does.

    python3 bench/store_pull.py [--json] [--reps 5] [--random 25 --half 20 --zero 35] [--verifiers 2]

Figures, medians of ``--reps`` rounds, the order of the four alternating in each round:
- plain_get_mb_s: the stored (compressed) chunks got as objects, ``IO_WORKERS`` at a time;
- pull_mb_s: ``forkd_engine.store.pull`` into an empty local store (fetch, decompress, sha256 of
  every chunk, write), the same bytes over its time;
- steps: the pull's own steps done again by this script with a timer around each (same threads,
  same order), summed over the pull's threads per round: ``get`` (obstore's get, wall), ``get_cpu``
  (the thread's CPU inside it), ``decompress``, ``sha256``, ``write`` (into the local store), and
  ``steps_mb_s`` (that run's rate, to show the timers change little);
- pipeline_mb_s: the same steps split as a pipeline instead, ``IO_WORKERS`` threads fetching and
  handing each chunk to ``--verifiers`` threads that decompress, hash and write it, and
  pipeline_over_pull_time: the median of its time over the pull's in the same round;
- gil_probe: how late a thread that sleeps 0.5 ms wakes while 8 threads get chunks (p50 / p90 / max
  ms), against 8 threads hashing: a step that held the GIL would make it late by the step's length.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine"))

import obstore
from forkd_engine.store import (
    ChunkCache,
    pull,
    push,
    transfer,
)
from forkd_engine.store import chunks as ck
from store import baseline, bucket, moto_process


def snapshot_file(path: str, random: int, half: int, zero: int) -> None:
    with open(path, "wb") as f:
        f.writelines(os.urandom(ck.CHUNK_SIZE) for _ in range(random))
        f.writelines(os.urandom(ck.CHUNK_SIZE // 2) + bytes(ck.CHUNK_SIZE // 2) for _ in range(half))
        f.write(bytes(ck.CHUNK_SIZE * zero))


def timed_pull(cache: ChunkCache, remote, manifest) -> dict:
    """The pull's steps (transfer.pull), each timed; seconds summed over the threads."""
    sizes = transfer._chunk_sizes(manifest)
    steps: dict[str, float] = {}
    lock = threading.Lock()

    def one(hexd: str) -> None:
        took = {}
        c0, t0 = time.thread_time(), time.perf_counter()
        blob = remote.get_chunk(hexd)
        took["get"], took["get_cpu"] = time.perf_counter() - t0, time.thread_time() - c0
        t0 = time.perf_counter()
        data = ck.decompress(blob, sizes[hexd])
        took["decompress"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if ck.digest(data) != hexd:
            raise RuntimeError(f"chunk {hexd} does not match")
        took["sha256"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache.write(hexd, blob)
        took["write"] = time.perf_counter() - t0
        with lock:
            for k, v in took.items():
                steps[k] = steps.get(k, 0.0) + v

    transfer._run(one, [c for c in manifest.chunks() if not cache.has(c)], transfer.IO_WORKERS)
    return steps


def pipelined_pull(cache: ChunkCache, remote, manifest, verifiers: int) -> None:
    """transfer.pull's steps as a pipeline: fetching threads hand chunks to verifying threads."""
    sizes = transfer._chunk_sizes(manifest)
    with ThreadPoolExecutor(verifiers) as verify:
        def fetch(hexd: str):
            blob = remote.get_chunk(hexd)
            return verify.submit(lambda: (transfer._verified(remote.url, hexd, blob, sizes[hexd]),
                                          cache.write(hexd, blob)))
        for done in transfer._run(fetch, [c for c in manifest.chunks() if not cache.has(c)], transfer.IO_WORKERS):
            done.result()
    cache.put_manifest(manifest)


def gil_probe(work) -> list[float]:
    """Lateness (ms) of a 0.5 ms sleep, over and over, while 8 threads run ``work(i)`` for i < 40."""
    late: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.0005)
            late.append((time.perf_counter() - t0 - 0.0005) * 1000)

    th = threading.Thread(target=probe)
    th.start()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(40)))
    stop.set()
    th.join()
    late.sort()
    return [round(late[len(late) // 2], 2), round(late[int(len(late) * 0.9)], 2), round(late[-1], 2)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--random", type=int, default=25, help="chunks of random bytes")
    ap.add_argument("--half", type=int, default=20, help="chunks half random, half zero")
    ap.add_argument("--zero", type=int, default=35, help="all-zero chunks (not stored)")
    ap.add_argument("--verifiers", type=int, default=2, help="verifying threads of the pipeline variant")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fkpull")
    server, endpoint = moto_process()
    try:
        path = os.path.join(root, "memory.bin")
        snapshot_file(path, args.random, args.half, args.zero)
        source = ChunkCache(os.path.join(root, "source"))
        manifest = transfer.persist(source, {"memory.bin": path}, {}, {"tag": "bench"})
        remote = bucket(endpoint, "pull")
        push(source, remote, manifest.digest)
        blobs = [source.read(c) for c in manifest.chunks()]
        mb = sum(map(len, blobs)) / 1e6
        got, pulled, stepped, steps, piped = [], [], [], [], []
        for rep in range(args.reps):
            order = ("get", "pull", "steps", "pipe") if rep % 2 else ("pipe", "steps", "pull", "get")
            for which in order:
                if which == "get":
                    got.append(baseline(remote, blobs)[1])
                    continue
                cache = ChunkCache(os.path.join(root, f"{which}{rep}"))
                t0 = time.monotonic()
                if which == "pull":
                    pull(cache, remote, manifest)
                    pulled.append(time.monotonic() - t0)
                elif which == "pipe":
                    pipelined_pull(cache, remote, manifest, args.verifiers)
                    piped.append(time.monotonic() - t0)
                else:
                    steps.append(timed_pull(cache, remote, manifest))
                    stepped.append(time.monotonic() - t0)
                shutil.rmtree(cache.root)
        data = os.urandom(ck.CHUNK_SIZE)
        paths = [f"plain/{i % len(blobs)}" for i in range(40)]
        probe = {"during_get_ms": gil_probe(lambda i: bytes(obstore.get(remote.store, paths[i]).bytes())),
                 "during_sha256_ms": gil_probe(lambda i: [hashlib.sha256(data).digest() for _ in range(3)])}
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)
    out = {"moved_mb": round(mb, 1), "chunks": len(blobs), "reps": args.reps, "io_workers": transfer.IO_WORKERS,
           "plain_get_mb_s": round(mb / statistics.median(got), 1), "pull_mb_s": round(mb / statistics.median(pulled), 1),
           "steps_mb_s": round(mb / statistics.median(stepped), 1),
           "pipeline_mb_s": round(mb / statistics.median(piped), 1), "verifiers": args.verifiers,
           "pipeline_over_pull_time": round(statistics.median(a / b for a, b in zip(piped, pulled)), 3),
           "steps_s": {k: round(statistics.median(s[k] for s in steps), 3) for k in steps[0]},
           "gil_probe": probe, "load": os.getloadavg()[0]}
    out["pull_over_plain_get"] = round(out["pull_mb_s"] / out["plain_get_mb_s"], 2)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:22} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
