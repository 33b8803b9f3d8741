"""Big arrays move into hugetlb pages while a sandbox idles (process/hugepages.py): the values, the
forks and the allocator stay exactly as they were, and a rewrite after a branch no longer splits
the memory into 4 KiB pages. Each sandbox's huge pages are capped at its memory limit (cgroups.py):
no more moves, and user code mapping huge pages itself meets the cap, never the host's pool.
Timing is bench/kernel.py's business; these assert what is copied."""

from __future__ import annotations

import os
import time

import pytest

from ..conftest import requires_root
from .conftest import cleanup, ev

pytestmark = requires_root

MIB = 2**20
ARRAY = """
import hashlib
big = np.arange(2**25, dtype=np.float64)  # 256 MiB of distinct values
digest = lambda a: hashlib.sha256(a.tobytes()).hexdigest()
before = digest(big)
"""


@pytest.fixture(scope="module")
def numpy_snap(ctl):
    engine = ctl.engines["process"]
    if not engine.huge_pages:
        pytest.skip(f"no hugetlb pool on this host: {engine.huge_pages_note}")
    return ctl.create_snapshot("hp", setup="import numpy as np\n"
                                           "import forkd_engine.process.compactor as compactor\n"
                                           "import forkd_engine.process.hugepages as hugepages")["tag"]


def run(ctl, sandbox_id: str, code: str) -> None:
    reply = ctl.run_code(sandbox_id, code, timeout=120)
    assert reply["exit_code"] == 0, reply


def moved_kib(ctl, sandbox_id: str, at_least_kib: int, within: float = 120) -> int:
    """Huge-page memory of the sandbox once it reaches ``at_least_kib`` (each look is a cell, after
    which the sandbox idles again and its background pass goes on)."""
    deadline = time.monotonic() + within
    while True:
        kib = int(ev(ctl, sandbox_id, "compactor.hugetlb_kib()"))
        if kib >= at_least_kib or time.monotonic() > deadline:
            return kib
        time.sleep(0.3)  # the pass starts after 50 ms of idleness; a look every 0.3 s lets it work


def test_a_big_array_moves_and_every_copy_stays_exact(ctl, numpy_snap):
    sb = ctl.spawn(numpy_snap, 1)[0]["id"]
    run(ctl, sb, ARRAY)
    assert moved_kib(ctl, sb, 254 * 1024) >= 254 * 1024  # all but the unaligned ends
    assert ev(ctl, sb, "digest(big) == before and float(big[12345]) == 12345.0") == "True"

    tag = ctl.branch(sb, live=True)["tag"]
    run(ctl, sb, "big += 1.0")  # copy-on-write of huge pages shared with the branch
    # the rewrite left nothing split: the next fork copies 2 MiB entries, not 4 KiB ones
    assert int(ev(ctl, sb, "compactor.split_anonymous_kib()")) < 64 * 1024
    assert ev(ctl, sb, "float(big[0]), float(big[-1])") == f"(1.0, {2.0**25:.1f})"

    kids = [k["id"] for k in ctl.spawn(tag, 2)]
    assert ev(ctl, kids[0], "digest(big) == before") == "True"   # the branch kept the old values
    run(ctl, kids[0], "big[::4096] = -1.0")                      # a child's writes stay its own
    assert ev(ctl, kids[1], "digest(big) == before") == "True"
    assert ev(ctl, sb, "float(big[0])") == "1.0"


def test_resize_and_free_still_work_on_moved_memory(ctl, numpy_snap):
    sb = ctl.spawn(numpy_snap, 1)[0]["id"]
    run(ctl, sb, ARRAY)
    assert moved_kib(ctl, sb, 254 * 1024) >= 254 * 1024
    # realloc of the chunk: glibc's mremap refuses the mixed range and falls back to a copy
    run(ctl, sb, "big.resize(2**25 + 7, refcheck=False)\nbig[-7:] = 5.0")
    assert ev(ctl, sb, "(digest(big[:2**25]) == before, float(big[-1]))") == "(True, 5.0)"
    # free() unmaps it; the pages go back (read in the same cell: once idle, the compactor may move
    # `other`, and with warm pages at hand it does so within milliseconds)
    run(ctl, sb, "big = None\nother = np.ones(8 * 2**20)\nafter_free = compactor.hugetlb_kib()")
    assert int(ev(ctl, sb, "after_free")) == 0


def test_shared_or_untouched_memory_is_not_moved(ctl, ctl_snap_with_array):
    # Memory shared with the snapshot (it would cost a second copy) and pages never touched (it
    # would allocate them) are not movable, asked of the sandbox itself.
    sb = ctl.spawn(ctl_snap_with_array, 1)[0]["id"]
    run(ctl, sb, "zeros = np.zeros(2**24)")  # 128 MiB, calloc'ed: no page touched
    assert ev(ctl, sb, "[len(hugepages.pieces(*b[3:])) for b in hugepages.find_buffers(globals())]") == "[0, 0]"
    run(ctl, sb, "big += 1.0\nzeros += 1.0\nimport forkd_engine.process.compactor as compactor")
    assert moved_kib(ctl, sb, 380 * 1024) >= 380 * 1024  # now its own, and resident: both move


@pytest.fixture(scope="module")
def ctl_snap_with_array(ctl, numpy_snap):
    return ctl.create_snapshot("hp-array", setup="import numpy as np\n"
                                                 "import forkd_engine.process.hugepages as hugepages\n"
                                                 "big = np.ones(2**25)")["tag"]


def hugetlb_leaf(ctl, handle: dict) -> str:
    """The leaf that caps a sandbox's (or template's) huge pages."""
    return next(p for p in handle["cgroups"] if os.path.exists(os.path.join(p, "hugetlb.2MB.max")))


def read(leaf: str, name: str) -> str:
    with open(os.path.join(leaf, name)) as f:
        return f.read().strip()


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":")))


def test_moves_stop_at_the_sandboxs_cap_and_the_rest_stays_exact(ctl, numpy_snap):
    # The cap is the memory limit, apart from it: 256 MiB of huge pages for a 256 MiB sandbox.
    sb = ctl.spawn(numpy_snap, 1, memory_limit_mib=256)[0]["id"]
    leaf = hugetlb_leaf(ctl, ctl.registry.get_sandbox(sb)["handle"])
    assert int(read(leaf, "hugetlb.2MB.max")) == int(read(leaf, "hugetlb.2MB.rsvd.max")) == 256 * MIB
    assert ev(ctl, sb, "[c.huge_pages_cap for c in __import__('gc').get_objects() "
                       "if isinstance(c, compactor.Compactor)]") == f"[{256 * MIB}]"
    run(ctl, sb, "import hashlib\ndigest = lambda a: hashlib.sha256(a.data).hexdigest()\n"
                 "a = np.arange(20 * 2**20, dtype=np.float64)\nda = digest(a)")  # 160 MiB
    assert moved_kib(ctl, sb, 150 * 1024) >= 150 * 1024
    # a was moved, so its ordinary memory is free again: b fits in the memory limit, and moves
    # until the huge pages reach the cap; its other pieces stay in ordinary pages
    run(ctl, sb, "b = np.arange(20 * 2**20, dtype=np.float64)\nb *= 3\ndb = digest(b)")
    held = moved_kib(ctl, sb, 240 * 1024)
    assert 240 * 1024 <= held <= 256 * 1024
    assert int(read(leaf, "hugetlb.2MB.current")) <= 256 * MIB
    assert read(leaf, "hugetlb.2MB.events") == "max 0"  # the compactor kept within the cap itself
    assert ev(ctl, sb, "(digest(a) == da, digest(b) == db, float(b[-1]), float(a[12345]))") == \
        f"(True, True, {3.0 * (20 * 2**20 - 1):.1f}, 12345.0)"


TOUCH = """
import mmap, sys
m = mmap.mmap(-1, 128 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000 | 0x4000)  # HUGETLB, NORESERVE
for i in range(64):
    m[i << 21] = 1
    print(i + 1, flush=True)
"""


@pytest.mark.exclusive  # reads the host's huge-page counters: no other test may take pages meanwhile
def test_map_hugetlb_past_the_limit_fails_and_takes_nothing_from_the_host(ctl, numpy_snap):
    sb = ctl.spawn(numpy_snap, 1, memory_limit_mib=64)[0]["id"]
    leaf = hugetlb_leaf(ctl, ctl.registry.get_sandbox(sb)["handle"])
    # the host's pool could give 128 MiB: only the sandbox's cap stands in the way
    with open("/proc/sys/vm/nr_overcommit_hugepages") as f:
        assert int(f.read()) - meminfo("HugePages_Surp") >= 64
    rsvd = meminfo("HugePages_Rsvd")
    # a mapping that reserves its pages: refused at mmap, in the cell
    reply = ctl.run_code(sb, "import mmap\ntry:\n    mmap.mmap(-1, 128 << 20, flags=mmap.MAP_PRIVATE | "
                             "mmap.MAP_ANONYMOUS | 0x40000)\nexcept OSError as e:\n    err = e.errno\nerr")
    assert reply["result"]["text/plain"] == "12"  # ENOMEM
    assert meminfo("HugePages_Rsvd") < rsvd + 64  # nothing of the 64 pages was reserved
    # a mapping that reserves nothing: each page is charged as it is touched, and the 33rd is refused
    out = ctl.exec(sb, ["python3", "-c", TOUCH])
    assert out["exit_code"] == -7 and out["stdout"].split()[-1] == "32"  # SIGBUS at 64 MiB exactly
    assert int(read(leaf, "hugetlb.2MB.events").split()[1]) >= 2
    assert int(read(leaf, "hugetlb.2MB.current")) == 0  # and what it had went back with it
    assert ctl.ping(sb)["pong"] is True


def test_a_raised_memory_limit_raises_the_huge_page_cap_with_it(ctl, numpy_snap):
    sb = ctl.spawn(numpy_snap, 1, memory_limit_mib=64)[0]["id"]
    leaf = hugetlb_leaf(ctl, ctl.registry.get_sandbox(sb)["handle"])
    ctl.update_sandbox(sb, memory_limit_mib=256)
    assert int(read(leaf, "hugetlb.2MB.max")) == int(read(leaf, "hugetlb.2MB.rsvd.max")) == 256 * MIB
    out = ctl.exec(sb, ["python3", "-c", TOUCH])  # 128 MiB of huge pages: past the old cap, within the new
    assert out["exit_code"] == 0 and out["stdout"].split()[-1] == "64", out


def test_a_sandbox_killed_by_its_huge_page_cap_says_so(ctl, numpy_snap):
    from forkd_server.errors import Gone, NotFound

    sb = ctl.spawn(numpy_snap, 1, memory_limit_mib=64)[0]["id"]
    # the agent itself touches huge pages past its cap: SIGBUS ends it (and its sandbox)
    with pytest.raises(Gone, match=r"it died of its huge-page cap \(64 MiB, as much as its memory limit\)") as during:
        ctl.run_code(sb, TOUCH)
    assert "huge-page cap (64 MiB of 2MB pages" in during.value.details["kernel"]
    with pytest.raises(NotFound, match="huge-page cap") as after:
        ctl.get_sandbox(sb)
    assert after.value.fields["ended"]["limit"] == "huge_pages" and "memory_limit_mib" in after.value.hint
    assert "SIGBUS" in after.value.details["kernel"]


def test_a_setup_takes_no_huge_pages_past_its_limit(ctl, numpy_snap):
    from forkd_server.errors import BadRequest

    setup = "import mmap\nm = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000)"
    with pytest.raises(BadRequest) as failure:  # the setup's own: a 400
        ctl.create_snapshot("hp-setup", setup=setup, memory_limit_mib=128)
    assert "huge-page cap" in failure.value.what and "memory_limit_mib" in failure.value.hint
    assert "Cannot allocate memory" in failure.value.details["traceback"]


def test_a_branch_takes_no_huge_pages_of_its_own(ctl, numpy_snap):
    sb = ctl.spawn(numpy_snap, 1)[0]["id"]
    tag = ctl.branch(sb)["tag"]
    leaf = hugetlb_leaf(ctl, ctl.registry.get_snapshot(tag)["handle"])
    assert int(read(leaf, "hugetlb.2MB.max")) == int(read(leaf, "hugetlb.2MB.rsvd.max")) == 0


@pytest.mark.exclusive  # the host's pool must stay as found: no other test's engine may raise it
def test_where_huge_pages_cannot_be_capped_no_sandbox_may_map_them(monkeypatch, short_dir):
    from forkd_engine.cgroups import Cgroups
    from forkd_server.controller import Controller

    monkeypatch.setattr(Cgroups, "hugetlb_status", lambda self: (False, "no hugetlb controller (test)"))
    with open("/proc/sys/vm/nr_overcommit_hugepages") as f:
        pool = f.read()
    c = Controller(short_dir)
    try:
        engine = c.engines["process"]
        assert not engine.huge_pages and "kept as found" in engine.huge_pages_note
        with open("/proc/sys/vm/nr_overcommit_hugepages") as f:
            assert f.read() == pool
        tag = c.create_snapshot("no-hp", setup="import mmap")["tag"]
        sb = c.spawn(tag, 1)[0]["id"]
        got = ev(c, sb, "[getattr(c, 'huge_pages_cap', None) for c in __import__('gc').get_objects() "
                        "if type(c).__name__ == 'Compactor']")
        assert got == "[0]"
        reply = c.run_code(sb, "try:\n    mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS "
                               "| 0x40000 | 0x4000)\nexcept OSError as e:\n    err = e.errno\nerr")
        assert reply["result"]["text/plain"] == "1"  # EPERM: the seccomp filter refuses it
    finally:
        cleanup(c)
        c.close()
