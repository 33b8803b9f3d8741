"""Big arrays move into hugetlb pages while a sandbox idles (process/hugepages.py): the values, the
forks and the allocator stay exactly as they were, and a rewrite after a branch no longer splits
the memory into 4 KiB pages. Timing is bench/kernel.py's business; these assert what is copied."""

from __future__ import annotations

import time

import pytest

from ..conftest import requires_root
from .conftest import ev

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
    run(ctl, sb, "big = None\nother = np.ones(8 * 2**20)")  # free() unmaps it; the pages go back
    assert int(ev(ctl, sb, "compactor.hugetlb_kib()")) == 0


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


def test_a_memory_limited_sandbox_keeps_its_memory(ctl, numpy_snap):
    # hugetlb pages are not charged to the memory cgroup: a limited sandbox never takes them
    sb = ctl.spawn(numpy_snap, 1, memory_limit_mib=1024)[0]["id"]
    assert ev(ctl, sb, "[c.huge_pages for c in __import__('gc').get_objects() "
                       "if isinstance(c, compactor.Compactor)]") == "[False]"
    free = ctl.spawn(numpy_snap, 1)[0]["id"]
    assert ev(ctl, free, "[c.huge_pages for c in __import__('gc').get_objects() "
                         "if isinstance(c, compactor.Compactor)]") == "[True]"
