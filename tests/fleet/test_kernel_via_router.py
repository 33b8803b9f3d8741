"""The forkd kernel pointed at a router (``FORKD_URL``) works unchanged: the notebook branches, forks,
checks a child out and travels back, every call placed or pinned by the router."""

from __future__ import annotations

import os
from unittest import mock

from jupyter_client.manager import start_new_kernel

from forkd_server.client import Controller
from forkd_server.controller.checks import host_memory_mib

from ..kernel.cells import run
from .fleet import fleet


def test_time_travel_through_the_router():
    with fleet(2) as (router, _), mock.patch.dict(os.environ, FORKD_URL=router.url, FORKD_TOKEN=router.token):
        km, kc = start_new_kernel(kernel_name="forkd-python")
        try:
            first = run(kc, "x = 21")
            assert first.ok, first.text
            branch = run(kc, "%forkd branch --live")
            assert branch.ok and "status='ready'" in branch.result, branch.text
            assert run(kc, "kids = %forkd fork -n 3").ok
            assert run(kc, "%forkd checkout kids[2]").ok
            assert run(kc, "x + 1").result == "22"
            assert run(kc, "x = 99").ok
            assert run(kc, "%forkd checkout -").ok
            assert run(kc, "x").result == "21"
            drawn = run(kc, "%%forkd run kids\nx * 2")
            assert drawn.ok and drawn.result.count("\n42\n") == 2 and "\n198" in drawn.result, drawn.text
            tree = run(kc, "%forkd tree")
            assert tree.ok, tree.text
            # everything the notebook made is on one host: the one its first snapshot was placed on
            api = Controller(router.url, router.token)
            assert len({s["host"] for s in api.list_sandboxes()}) == 1
            # the kernel asks for "host" (all the memory of whichever host the router picks): that host resolves it
            assert {s["memory_limit_mib"] for s in api.list_sandboxes()} == {host_memory_mib()}
        finally:
            kc.stop_channels()
            if km.is_alive():
                km.shutdown_kernel(now=False)
