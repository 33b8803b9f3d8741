"""A notebook is never silently fresh on a fleet: a forkd kernel marked left through the router
(``POST /v1/kernels/{id}/leave``, what a stopping Jupyter server calls) has its notebook's HEAD kept
by the router, so the notebook's next kernel is told where the state runs even when its new HEAD
lands on another host (two hosts hold the base snapshot); told once, across a router restart, and
not at all once that sandbox is gone."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

import pytest

from forkd_server.client import Controller, ControllerError

from ..rest import exchange
from .fleet import fleet

NOTEBOOK = "work/across.ipynb"


def take_left(url: str, token: str, **query) -> tuple[int, dict]:
    """``DELETE /v1/kernels-left?...``: (status, JSON answer)."""
    return exchange(f"{url}/v1/kernels-left?{urllib.parse.urlencode(query)}", "DELETE",
                    headers={"Authorization": f"Bearer {token}"})


def test_the_next_kernel_is_told_on_another_host_once():
    with fleet(2) as (router, hosts):  # on exit every host's objects are deleted
        api = Controller(router.url, router.token, timeout=120)
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        for host in direct:  # the notebook's base snapshot on both hosts
            host.create_snapshot("base", setup="pass")
        on_a, on_b = (host.spawn_sandboxes("base", 1)[0]["id"] for host in direct)

        api.set_kernel_head("k-old", on_a, notebook=NOTEBOOK)  # its record on host A
        assert api.leave_kernel("k-old") is None
        with pytest.raises(ControllerError) as gone:  # the record went from its host
            direct[0].get_kernel("k-old")
        assert gone.value.status == 404

        router.stop()  # what the router keeps is in router.db
        router.start()
        router.wait(lambda h: h["hosts_up"] >= 2, "see both hosts up again")

        told = api.set_kernel_head("k-new", on_b, notebook=NOTEBOOK)  # the new HEAD is on host B
        left = told.get("left") or {}
        assert (left.get("head"), left.get("kernel_id"), left.get("host")) == (on_a, "k-old", hosts[0].url), told
        assert "left" not in api.set_kernel_head("k-new", on_b, notebook=NOTEBOOK)  # said once
        # nor does host A say it again to a kernel of the notebook whose HEAD lands there
        assert "left" not in api.set_kernel_head("k-third", on_a, notebook=NOTEBOOK)
        assert "left" not in direct[0].set_kernel_head("k-fourth", on_a, notebook=NOTEBOOK)
        for host, kernel in ((direct[0], "k-third"), (direct[0], "k-fourth")):
            host.forget_kernel(kernel)

        # the HEAD left is gone by the time the next kernel registers: nothing to name
        assert api.leave_kernel("k-new") is None
        api.kill_sandbox(on_b)
        assert "left" not in api.set_kernel_head("k-last", on_a, notebook=NOTEBOOK)
        api.forget_kernel("k-last")
        assert api.list_kernels() == []


def test_taking_a_notebook_s_left_head_on_a_host_and_through_the_router():
    with fleet(2) as (router, hosts):
        api = Controller(router.url, router.token, timeout=120)
        direct = Controller(hosts[1].url, hosts[1].token, timeout=120)
        direct.create_snapshot("base", setup="pass")
        sb = direct.spawn_sandboxes("base", 1)[0]["id"]
        for url, token in ((hosts[1].url, hosts[1].token), (router.url, router.token)):
            status, said = take_left(url, token)
            assert status == 400 and "notebook is required" in said["error"], said
            status, said = take_left(url, token, notebook=NOTEBOOK)
            assert status == 404 and NOTEBOOK in said["error"], said
        direct.set_kernel_head("k-a", sb, notebook=NOTEBOOK)
        direct.leave_kernel("k-a")
        assert take_left(hosts[1].url, hosts[1].token, notebook=NOTEBOOK, head="sb-other")[0] == 404  # not that HEAD
        status, said = take_left(router.url, router.token, notebook=NOTEBOOK)
        assert status == 200 and (said["head"], said["kernel_id"], said["host"]) == (sb, "k-a", hosts[1].url), said
        assert take_left(hosts[1].url, hosts[1].token, notebook=NOTEBOOK)[0] == 404  # taken
        assert "left" not in api.set_kernel_head("k-b", sb, notebook=NOTEBOOK)
        api.forget_kernel("k-b")
