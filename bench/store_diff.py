"""Where a diff branch's upload goes: its chunks against its parent's, file by file.

    python3 bench/store_diff.py --json
    python3 bench/store_diff.py --mem 512 --numpy-mb 100 --changed 0.1

The guest and the change are ``bench/store.py``'s (a 512 MiB VM holding ``--numpy-mb`` MB of random
float64s; a child that adds 1.0 to ``--changed`` of guest RAM in the array, branched in diff mode).
Both snapshots are kept in a local store the way the engine keeps them (``store_snapshot``: the
branch against its parent), then each chunk of the branch is compared with the parent's chunk at the
same offset:

- per file: chunks unchanged, zero, kept as a page patch, kept whole, and the bytes each kind adds
  to a push after the parent's (compressed);
- per changed chunk: how many of its 1024 pages differ, and what it would cost stored three ways:
  zstd alone, a page patch (bitmap + changed pages XORed with the parent's, zstd: what the store
  does for few pages), the same with the pages themselves (plain_page_patch), and zstd with the
  parent's chunk as a raw-content dictionary (dict_delta: a delta against the parent);
- the floor: the rewritten array bytes alone, compressed with zstd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

import zstandard  # noqa: E402
from forkd_engine import ChildSpec, SnapshotSpec  # noqa: E402
from forkd_engine.store import chunks as ck  # noqa: E402
from forkd_engine.store.manifest import content_digest  # noqa: E402
from forkd_engine.vm import VMEngine  # noqa: E402
from forkd_engine.vm.durable import files_of  # noqa: E402

CHUNK_PAGES = ck.CHUNK_SIZE // ck.PAGE


def run(engine, h, code):
    reply = engine.call(h, {"action": "run_code", "code": code}, timeout=600)
    if reply.get("error"):
        raise RuntimeError(reply["error"])
    return reply


def dict_delta(base: bytes, data: bytes) -> int:
    """zstd of ``data`` with ``base`` as a raw-content dictionary, its window wide enough to reach
    all of it (at the default window most of a 4 MiB dictionary is out of reach)."""
    d = zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    params = zstandard.ZstdCompressionParameters.from_level(ck.LEVEL, source_size=len(data), window_log=23)
    return len(zstandard.ZstdCompressor(dict_data=d, compression_params=params).compress(data))


def plain_patch(base: bytes, data: bytes) -> int | None:
    """A page patch of the changed pages themselves (not XORed with the parent's), zstd: what the
    store kept before its patches were XORed."""
    patch = ck.page_patch(base, data)
    if patch is None:
        return None
    out = bytearray(patch[:CHUNK_PAGES // 8])
    for i in range(CHUNK_PAGES):
        if patch[i >> 3] >> (i & 7) & 1:
            out += data[i * ck.PAGE:(i + 1) * ck.PAGE]
    return len(ck.compress(bytes(out)))


def changed_pages(a: bytes, b: bytes) -> int:
    return sum(a[i:i + ck.PAGE] != b[i:i + ck.PAGE] for i in range(0, min(len(a), len(b)), ck.PAGE))


def analyse(store, parent_m, child_m, parent_files, child_files) -> dict:
    out = {}
    for name, entry in child_m.files.items():
        before = parent_m.files.get(name, {"chunks": []})["chunks"]
        kinds = {"unchanged": 0, "zero": 0, "patch": 0, "whole": 0}
        added = {"patch": 0, "whole": 0}
        per_chunk = []
        with open(child_files[name], "rb") as fc, open(parent_files.get(name, os.devnull), "rb") as fp:
            for i, c in enumerate(entry["chunks"]):
                p = before[i] if i < len(before) else None
                if c is None:
                    kinds["zero"] += 1
                    continue
                if p is not None and content_digest(p) == content_digest(c):
                    kinds["unchanged"] += 1
                    continue
                kind = "patch" if isinstance(c, dict) else "whole"
                kinds[kind] += 1
                obj = c["patch"] if kind == "patch" else c
                added[kind] += store.size(obj)
                fc.seek(i * ck.CHUNK_SIZE)
                data = fc.read(ck.CHUNK_SIZE)
                fp.seek(i * ck.CHUNK_SIZE)
                base = fp.read(ck.CHUNK_SIZE)
                row = {"file": name, "chunk": i, "kind": kind, "stored": store.size(obj),
                       "zstd": len(ck.compress(data))}
                if len(base) == len(data) == ck.CHUNK_SIZE:
                    row["pages_changed"] = changed_pages(base, data)
                    row["dict_delta"] = dict_delta(base, data)
                    patch = ck.page_patch(base, data)
                    row["page_patch"] = len(ck.compress(patch)) if patch is not None else None
                    row["plain_page_patch"] = plain_patch(base, data)
                per_chunk.append(row)
        out[name] = {"chunks": len(entry["chunks"]), **kinds, "added_bytes": added, "changed": per_chunk}
    return out


def floor(n: int, rewrite: int) -> int:
    """The rewritten array bytes (the same generator as the guest's), compressed chunk by chunk."""
    import numpy as np

    new = (np.random.default_rng(1).random(n)[:rewrite] + 1.0).tobytes()
    return sum(len(ck.compress(new[i:i + ck.CHUNK_SIZE])) for i in range(0, len(new), ck.CHUNK_SIZE))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mem", type=int, default=512)
    ap.add_argument("--numpy-mb", type=int, default=100)
    ap.add_argument("--changed", type=float, default=0.10)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fkdiff", dir=os.environ.get("FORKD_BENCH_DIR"))
    engine = VMEngine(os.path.join(root, "vm"))
    handles = []
    try:
        n = args.numpy_mb * 1_000_000 // 8
        setup = f"import numpy as np\narr = np.random.default_rng(1).random({n})\n"
        parent = engine.create_snapshot(SnapshotSpec(tag="parent", mem_size_mib=args.mem, packages=["python3-numpy"],
                                                     setup=setup, setup_timeout=900))
        handles.append(parent)
        pd = engine.store_snapshot(parent)
        kid = engine.spawn(parent, [ChildSpec(id="kid", lineage=["parent", "kid"])])[0]
        handles.append(kid)
        ram = args.mem << 20
        rewrite = min(int(args.changed * ram) // 8, n)
        run(engine, kid, f"arr[:{rewrite}] += 1.0")
        child = engine.branch(kid, "branch", ["parent", "kid", "branch"], mode="diff").ready.result(timeout=600)
        handles.append(child)
        engine.kill(kid)
        handles.remove(kid)
        cd = engine.store_snapshot(child)
        pm, cm = engine.store.get_manifest(pd), engine.store.get_manifest(cd)
        parent_bytes = pm.stored_bytes({c: engine.store.size(c) for c in pm.chunks()})
        new = [c for c in cm.chunks() if c not in set(pm.chunks())]
        diff_bytes = sum(engine.store.size(c) for c in new)
        files = analyse(engine.store, pm, cm, files_of(parent), files_of(child))
        changed = [r for f in files.values() for r in f["changed"]]
        out = {"guest_ram_mib": args.mem, "numpy_mb": args.numpy_mb, "changed": args.changed,
               "rewritten_bytes": rewrite * 8, "parent_bytes": parent_bytes, "diff_bytes": diff_bytes,
               "diff_ratio": round(diff_bytes / parent_bytes, 3), "floor_bytes": floor(n, rewrite),
               "if_every_changed_chunk": {k: sum((r.get(k) or r["zstd"]) for r in changed)
                                          for k in ("zstd", "page_patch", "plain_page_patch", "dict_delta")},
               "files": {n: {k: v for k, v in f.items() if k != "changed"} for n, f in files.items()},
               "changed_chunks": changed}
        out["if_every_changed_chunk_ratio"] = {k: round(v / parent_bytes, 3)
                                               for k, v in out["if_every_changed_chunk"].items()}
    finally:
        for h in handles:
            (engine.kill if h.get("kind") == "vm" else engine.delete_snapshot)(h)
        engine.close()
        shutil.rmtree(engine.mem_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if k != "changed_chunks":
                print(f"{k:28} {v}")
        for r in out["changed_chunks"]:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
