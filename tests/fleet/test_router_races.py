"""What the router meets between its look at a host and the host's answer: a host that filled up
after the router read its room (a fork over the cap it then answers 503). The host is reached
through a forwarding stand-in (fleet.py), which fills it at the moment the fork reaches it."""

from __future__ import annotations

import pytest

from forkd_server.client import Controller, ControllerError

from .fleet import Router, fleet, forwarding, stand_in_host

CAP = 3


def test_a_fork_its_host_refuses_over_a_stale_figure_is_refused_host_local_and_leaves_nothing():
    """The router read room for both children (1 of 3 held), then the host filled to 2 of 3 before
    the fork reached it: the host's 503 is not passed on as it is; a process-engine source is
    refused as host-local, with the room the host has now, and nothing of the fork is left."""
    with fleet(2, host_args=[[f"--ForkdApp.max_sandboxes={CAP}"], []], router=False) as (workdir, hosts):
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        filled: list[dict] = []

        def fill(method: str, path: str) -> None:
            if method == "POST" and path.endswith("/fork") and not filled:
                filled.extend(direct[0].spawn_sandboxes("stale", 1))  # not through the router

        with stand_in_host(forwarding(hosts[0].url, fill)) as near:
            router = Router([near, hosts[1].url], workdir)
            try:
                router.wait(lambda h: h["hosts_up"] >= 2, "see both hosts up")
                api = Controller(router.url, router.token, timeout=120)
                direct[0].create_snapshot("stale", setup="v = 1")
                source = api.spawn_sandboxes("stale")[0]
                assert source["host"] == near
                with pytest.raises(ControllerError) as err:
                    api.fork_sandbox(source["id"], 2)
                said = str(err.value)
                assert filled, "the fork never reached the host"
                assert err.value.status == 503, said
                assert f"sandbox {source['id']} runs on the process engine" in said, said
                assert "room for 1 of the 2 children" in said and "host-local and never move" in said, said
                assert sorted(s["id"] for s in direct[0].list_sandboxes()) == sorted([source["id"], filled[0]["id"]])
                assert {s["tag"] for s in direct[0].list_snapshots()} == {"stale"}
                assert direct[1].list_sandboxes() == [] and direct[1].list_snapshots() == []
            finally:
                router.stop()
