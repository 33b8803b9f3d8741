"""A notebook is never silently fresh on a fleet: a forkd kernel marked left through the router
(``POST /v1/kernels/{id}/leave``, what a stopping Jupyter server calls) has its notebook's HEAD kept
by the router, so the notebook's next kernel is told where the state runs even when its new HEAD
lands on another host (two hosts hold the base snapshot); told once, across a router restart, and
not at all once that sandbox is gone."""

from __future__ import annotations

import pytest

from forkd_server.client import Controller, ControllerError

from .fleet import fleet

NOTEBOOK = "work/across.ipynb"


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
