"""The warm reserve of free huge pages (process/reserve.py): how much it keeps, whose pool it leaves
alone, and on a real host that it covers the pages in use and that the last engine gives it back.
What it buys (the first write after a branch) is bench/kernel.py's figure."""

from __future__ import annotations

import fcntl
import os
import time

import pytest
from forkd_engine.process import reserve
from forkd_engine.process.hugepages import HUGE, Destination

GIB_KB = 1 << 20


def info(total: int, free: int, rsvd: int = 0, available_kb: int = 20 * GIB_KB) -> dict[str, int]:
    return {"HugePages_Total": total, "HugePages_Free": free, "HugePages_Rsvd": rsvd,
            "MemTotal": 24 * GIB_KB, "MemAvailable": available_kb}


def test_it_grows_to_cover_the_pages_in_use_once_they_settled():
    assert reserve.plan(info(512, 0), 1536, settled=True, over_for=0) == 512
    assert reserve.plan(info(512, 0), 1536, settled=False, over_for=0) == 0  # a copy or move is under way
    assert reserve.plan(info(800, 200), 1536, settled=True, over_for=0) == 400
    assert reserve.plan(info(1024, 512), 1536, settled=True, over_for=0) == 0  # covered


def test_it_stays_under_its_ceiling_and_leaves_a_quarter_of_memory_available():
    assert reserve.plan(info(4000, 0), 1536, settled=True, over_for=0) == 1536
    assert reserve.plan(info(4000, 100), 1536, settled=True, over_for=0) == 1436
    # 7 GiB available of 24: 1 GiB above the quarter kept available, 512 pages
    assert reserve.plan(info(4000, 0, available_kb=7 * GIB_KB), 1536, settled=True, over_for=0) == 512
    assert reserve.plan(info(4000, 0, available_kb=5 * GIB_KB), 1536, settled=True, over_for=0) == 0


def test_a_host_short_of_memory_gets_the_reserve_back_at_once():
    # 2.5 GiB available of 24, under the eighth (3 GiB): half a GiB of the reserve goes, unsettled or not
    assert reserve.plan(info(1024, 512, available_kb=5 * GIB_KB // 2), 1536, settled=False, over_for=0) == -256
    assert reserve.plan(info(1024, 100, available_kb=GIB_KB), 1536, settled=True, over_for=0) == -100
    assert reserve.plan(info(1024, 0, available_kb=GIB_KB), 1536, settled=True, over_for=0) == 0


def test_pages_reserved_by_a_mapping_are_not_counted_as_free():
    assert reserve.plan(info(1024, 512, rsvd=512), 1536, settled=True, over_for=0) == 512


def test_it_gives_back_only_what_stayed_past_the_slack_for_a_while():
    freed = info(2048, 1536)  # a deleted branch freed a GiB: 512 in use, 1536 free
    assert reserve.over(freed, 1536)
    assert reserve.plan(freed, 1536, settled=True, over_for=reserve.KEEP / 2) == 0
    assert reserve.plan(freed, 1536, settled=True, over_for=reserve.KEEP) == -1024
    within = info(512 + 600, 600)  # 88 past the reserve of 512: within its quarter
    assert not reserve.over(within, 1536)
    assert reserve.plan(within, 1536, settled=True, over_for=10 * reserve.KEEP) == 0


def test_a_pool_forkd_did_not_make_is_left_alone(tmp_path, monkeypatch):
    pool, lock = tmp_path / "nr_hugepages", tmp_path / "lock"
    pool.write_text("7\n")   # an administrator's pool
    lock.write_text("0")     # forkd last wrote 0
    monkeypatch.setattr(reserve, "POOL", str(pool))
    monkeypatch.setattr(reserve, "LOCK", str(lock))
    monkeypatch.setattr(reserve, "ENGINES", str(tmp_path / "engines"))
    monkeypatch.setattr(reserve, "TICK", 3600)  # no look of its own: step() below is the only one
    r = reserve.HugePageReserve()
    try:
        assert r.step() == 0
        assert "host's own pool of 7 huge pages" in r.note
        assert pool.read_text() == "7\n" and lock.read_text() == "0"
    finally:
        r.close()
    assert pool.read_text() == "7\n"  # not emptied by the last engine either
    assert "host's own pool" in reserve.describe()


def test_a_bad_ceiling_says_what_it_wants(monkeypatch):
    monkeypatch.setenv("FORKD_HUGE_PAGE_RESERVE_MIB", "lots")
    with pytest.raises(ValueError, match="FORKD_HUGE_PAGE_RESERVE_MIB must be a whole number of MiB"):
        reserve.ceiling_pages()
    monkeypatch.setenv("FORKD_HUGE_PAGE_RESERVE_MIB", "0")
    assert reserve.start() is None


def _no_other_engine() -> bool:
    with open(reserve.ENGINES, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


@pytest.mark.exclusive  # reads the host's huge-page counters: no other test may take pages meanwhile
def test_on_this_host_it_covers_the_pages_in_use_and_the_last_engine_gives_them_back(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the pool is root's")
    with open("/proc/sys/vm/nr_overcommit_hugepages") as f:
        if int(f.read()) < 64:
            pytest.skip("no surplus huge pages on this host (the process engine raises the ceiling as it starts)")
    monkeypatch.setenv("FORKD_HUGE_PAGE_RESERVE_MIB", "32")  # 16 pages
    monkeypatch.setattr(reserve, "TICK", 0.05)
    held = Destination(16 * HUGE)  # 16 pages in use, as a sandbox's moved array
    r = None
    try:
        assert held.fill(lambda: False)
        r = reserve.HugePageReserve()
        deadline = time.monotonic() + 60
        while True:
            m = reserve.meminfo()
            if m["HugePages_Free"] - m["HugePages_Rsvd"] >= 16:
                break
            assert time.monotonic() < deadline, f"the reserve did not cover 16 pages in use: {m}, {r.note!r}"
            time.sleep(0.05)
        with reserve.HugePageReserve._locked(wait=True) as (_, ours):  # not in the middle of a change
            assert reserve._pool() in ours - {0}  # a pool forkd made, and recorded as its own
        # a fault takes the free pool pages first: 8 more pages in use and no surplus page made
        surplus = reserve.meminfo()["HugePages_Surp"]
        more = Destination(8 * HUGE)
        try:
            assert more.fill(lambda: False)
            assert reserve.meminfo()["HugePages_Surp"] <= surplus
        finally:
            more.close()
    finally:
        if r is not None:
            r.close()
        held.close()
    if _no_other_engine():
        with open(reserve.POOL) as pool:
            assert pool.read().strip() == "0"  # the last engine gave the reserve back
