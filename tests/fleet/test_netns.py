"""The router in the root network namespace, each ``forkd serve`` host in a namespace of its own
behind a veth link: calls cross a real link, and a cut link (the host alive but unreachable) makes
the host down, its sandboxes lost, until the link is mended."""

from __future__ import annotations


import pytest

from forkd_server.client import Controller, ControllerError
from forkd_server.streaming import Session

from .fleet import DOWN_AFTER, fleet, wait_for
from .netns import NamespacedServer, available

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


def test_hosts_in_namespaces_and_a_cut_link():
    with fleet(2, server=NamespacedServer) as (router, hosts):
        assert all(not h.url.startswith("http://127.") for h in hosts)
        api = Controller(router.url, router.token, timeout=120)
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        direct[0].create_snapshot("a", setup="side = 'a'")
        direct[1].create_snapshot("b", setup="side = 'b'")
        ka = api.spawn_sandboxes("a")[0]
        kb = api.spawn_sandboxes("b", 2)
        assert ka["host"] == hosts[0].url and {k["host"] for k in kb} == {hosts[1].url}
        assert api.eval_code(kb[0]["id"], "side")["result"] == "'b'"
        seen = []
        with Session(api, ka["id"]) as s:
            assert s.execute("print(side)", on_event=seen.append)["status"] == "ok"
        assert "".join(e.get("text", "") for e in seen) == "a\n"

        hosts[1].partition()
        try:
            lost = wait_for(lambda: {s["id"] for s in api.list_sandboxes() if s["status"] == "lost"},
                            "host 1's sandboxes lost", timeout=DOWN_AFTER + 30)
            assert lost == {k["id"] for k in kb}
            with pytest.raises(ControllerError) as err:
                api.eval_code(kb[0]["id"], "side")
            assert err.value.status == 410
            assert api.eval_code(ka["id"], "side")["result"] == "'a'"  # the other host is untouched
        finally:
            hosts[1].heal()
        wait_for(lambda: router.hosts()[hosts[1].url]["state"] == "up", "host 1 reachable again")
        assert api.eval_code(kb[1]["id"], "side")["result"] == "'b'"
        for k in [ka, *kb]:
            api.kill_sandbox(k["id"])
