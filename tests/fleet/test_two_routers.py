"""Two routers on one state file (``router.db``): spawns through both at once never give one id to
two sandboxes (an id is claimed in one SQLite transaction), each router reaches what the other
placed, and a router killed with -9 and started again has every pin."""

from __future__ import annotations

import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor

from forkd_server.client import Controller

from .fleet import Router, fleet

ROUNDS = 4


def pinned_sandboxes(workdir: str) -> dict[str, str]:
    db = sqlite3.connect(f"file:{os.path.join(workdir, 'router', 'router', 'router.db')}?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT key, host FROM pins WHERE kind='sandbox'").fetchall())
    finally:
        db.close()


def test_two_routers_on_one_state_file_never_place_one_id_twice():
    with fleet(2) as (first, hosts):
        second = Router([h.url for h in hosts], first.workdir)  # the same --data-dir: the same router.db
        try:
            second.wait(lambda h: h["hosts_up"] >= 2, "see every host up")
            routers = [Controller(r.url, r.token, timeout=120) for r in (first, second)]
            for i, h in enumerate(hosts):
                Controller(h.url, h.token).create_snapshot(f"n{i}", setup=f"me = {i}")
            made = []
            with ThreadPoolExecutor(2) as pool:  # hosts counting alike, spawned through both routers at once
                for _ in range(ROUNDS):
                    made += [k for kids in pool.map(lambda i: routers[i].spawn_sandboxes(f"n{i}", 3), (0, 1))
                             for k in kids]
            assert len({k["id"] for k in made}) == len(made) == ROUNDS * 6
            urls = [h.url for h in hosts]
            for k in made:  # each id names one sandbox, through either router
                for api in routers:
                    assert api.eval_code(k["id"], "me")["result"] == str(urls.index(k["host"])), k
            assert pinned_sandboxes(first.workdir) == {k["id"]: k["host"] for k in made}

            first.stop(kill=True)  # kill -9 mid-life, then again on the same file: no pin lost
            first.start()
            first.wait(lambda h: h["hosts_up"] >= 2, "see every host up again")
            assert pinned_sandboxes(first.workdir) == {k["id"]: k["host"] for k in made}
            for k in made:
                assert routers[0].get_sandbox(k["id"])["host"] == k["host"]
                routers[1 - urls.index(k["host"])].kill_sandbox(k["id"])
        finally:
            second.stop()
