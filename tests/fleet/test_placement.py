"""Placement alone (pure: no hosts, no I/O): who gets the children of spawn(tag, n)."""

from __future__ import annotations

import random

import pytest

from forkd_server.fleet.hosts import Capacity
from forkd_server.fleet.placement import Candidate, NoRoom, Part, place, ranked

GIB = 1 << 30


def c(host, holds=True, engine="process", mem=None, free=None):
    return Candidate(host, holds, engine if holds else None, mem, free)


def test_one_holder_with_room_takes_all():
    assert place("t", 5, [c("a", free=10), c("b", holds=False, free=10)]) == [Part("a", 5, False)]


def test_a_host_that_states_no_cap_takes_all():
    assert place("t", 500, [c("a")]) == [Part("a", 500, False)]


def test_best_of_k_picks_the_most_free_memory_of_its_sample():
    hosts = [c("a", mem=1 * GIB), c("b", mem=8 * GIB)]
    for seed in range(20):  # with K=2 of 2 hosts, the sample is both: b always wins
        assert place("t", 1, hosts, random.Random(seed))[0].host == "b"
    many = [c(f"h{i}", mem=i * GIB) for i in range(10)]
    firsts = {ranked(many, random.Random(seed))[0].host for seed in range(200)}
    assert len(firsts) > 3 and "h0" not in firsts  # load spread, and never the worst of two


def test_split_across_holders_when_none_fits():
    hosts = [c("a", mem=8 * GIB, free=3), c("b", mem=4 * GIB, free=2), c("c", mem=2 * GIB, free=5)]
    parts = place("t", 7, hosts, random.Random(1))
    assert sum(p.n for p in parts) == 7 and all(not p.pull for p in parts)
    assert all(p.n <= {"a": 3, "b": 2, "c": 5}[p.host] for p in parts)


def test_full_hosts_are_skipped():
    assert place("t", 2, [c("a", free=0), c("b", free=4)]) == [Part("b", 2, False)]


def test_a_process_snapshot_never_moves():
    hosts = [c("a", free=2), c("b", holds=False, free=100)]
    with pytest.raises(NoRoom) as err:
        place("local", 5, hosts)
    assert err.value.room == 2 and err.value.status == 503
    assert "process-engine snapshot" in err.value.message and "host-local" in err.value.message
    assert 'engine "vm"' in err.value.message and "--store" in err.value.message


def test_a_vm_snapshot_spills_to_hosts_that_pull_it_after_the_holders():
    hosts = [c("a", engine="vm", free=2), c("b", holds=False, free=10, mem=GIB), c("c", holds=False, free=1)]
    parts = place("v", 6, hosts, random.Random(3))
    assert parts[0] == Part("a", 2, False)
    assert sum(p.n for p in parts) == 6 and all(p.pull for p in parts[1:])
    with pytest.raises(NoRoom) as err:
        place("v", 20, hosts)
    assert err.value.room == 13 and "room for 13 of the 20" in err.value.message


def test_capacity_is_read_defensively():
    assert Capacity.parse({"ok": True}) is None
    assert Capacity.parse({"capacity": "lots"}) is None
    cap = Capacity.parse({"capacity": {"memory_free": 5, "sandboxes": True, "max_sandboxes": 4, "load": "x"}})
    assert cap == Capacity(5, None, 4, None, None) and cap.free_slots is None  # no count: no limit known
    cap = Capacity.parse({"capacity": {"memory_free": 5, "sandboxes": 6, "max_sandboxes": 4, "snapshots": 1,
                                       "load": 0.5}})
    assert cap.free_slots == 0 and cap.counted(-3).free_slots == 1
    assert Capacity.parse({"capacity": {"sandboxes": 2, "max_sandboxes": None}}).free_slots is None
