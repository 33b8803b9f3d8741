"""Sandbox ids are numbered per host (``sb-<second>-<n>``): two hosts counting alike hand out the same
id in the same second (a new data dir's numbering begins at random, so the tests make them count alike). Through the router every id names one sandbox, a fork tree's children too
(which the host makes itself, outside any spawn the router placed)."""

from __future__ import annotations

import time

import pytest

from forkd_server.client import Controller

from .fleet import count_alike, fleet

ATTEMPTS = 10  # tries at making a spawn and a fork fall in the same second


def start_of_a_second() -> None:
    """Return just after the clock turns a second (a spawn and a fork then share it)."""
    while time.time() % 1 > 0.05:
        time.sleep(0.005)


def test_a_fork_child_whose_id_another_host_uses_is_made_again_under_a_new_id():
    with fleet(2) as (router, hosts):
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        api = Controller(router.url, router.token, timeout=120)
        direct[0].create_snapshot("n0", setup="me = 0")
        direct[1].create_snapshot("n1", setup="me = 1")
        count_alike(hosts)
        source = direct[1].spawn_sandboxes("n1", 1)[0]["id"]  # host 1 counts 1
        direct[0].kill_sandbox(direct[0].spawn_sandboxes("n0", 1)[0]["id"])  # and so does host 0
        clashed = False
        for _ in range(ATTEMPTS):
            start_of_a_second()
            spawned = api.spawn_sandboxes("n0", 2)  # host 0 numbers them c, c+1
            made = api._request("POST", f"/v1/sandboxes/{source}/fork", {"count": 2})  # host 1 alike
            kids = made["sandboxes"]
            ids = [k["id"] for k in spawned + kids]
            assert len(set(ids)) == 4, ids
            assert {k["host"] for k in kids} == {hosts[1].url}
            for k in kids:  # each id reaches its own sandbox: a copy of host 1's source
                assert api.eval_code(k["id"], "me")["result"] == "1", k
                assert api.get_sandbox(k["id"])["host"] == hosts[1].url
            for k in spawned:
                assert api.eval_code(k["id"], "me")["result"] == "0", k
            # the remade children are the tree's: promote keeps one and kills its siblings
            kept = api._request("POST", f"/v1/sandboxes/{kids[0]['id']}/promote", {"tree_id": made["fork_tree_id"]})
            assert set(kept["killed"]) == {k["id"] for k in kids[1:]}, kept
            clashed = "made again under new ids" in router.output()
            for sid in [kids[0]["id"], *(k["id"] for k in spawned)]:
                api.kill_sandbox(sid)
            if clashed:
                break
        if not clashed:  # a machine too loaded to spawn and fork within one second, every time
            pytest.skip(f"no fork fell in the same second as a spawn in {ATTEMPTS} tries")
