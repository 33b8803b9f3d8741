"""A host too slow for the router's merged lists: the SDK's answer says which host is missing and
why (a ``Partial`` list, sync and async), ``forkd ls`` / ``forkd kill --tag`` and ``%forkd ls`` say
what is not listed (or killed), and the lineage widget keeps what that host holds drawn as last
seen, marked, instead of burying it as killed or deleted; once the host answers again, its nodes
are drawn as they are. The host is reached through a forwarding stand-in (fleet.py) that
holds its listings back, as a slow link or a host under load would; its heartbeat passes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest
from IPython.lib.pretty import pretty

from forkd_magics._static import host_label, static_svg
from forkd_magics._magics import ForkdMagics
from forkd_magics._widget import LineageWidget
from forkd_server.client import AsyncController, Controller, Partial

from ..magics.test_widget import comms  # noqa: F401 (a fixture: the widget's comms, recorded)
from ..serving import FORKD
from .fleet import HOST_TIMEOUT, Router, fleet, forwarding, stand_in_host

LISTINGS = ("/v1/sandboxes", "/v1/snapshots", "/v1/tree")


@pytest.fixture
def slow_link():
    """(router, hosts, near, slow): the router reaches the first host at ``near``, whose listings
    wait while ``slow`` is set (until the fixture ends, at most 30 s)."""
    if os.geteuid() != 0:
        pytest.skip("the process engine needs root")
    slow, released = threading.Event(), threading.Event()

    def before(method: str, path: str) -> None:
        if method == "GET" and path.split("?")[0] in LISTINGS and slow.is_set():
            released.wait(30)

    with fleet(2, router=False) as (workdir, hosts), \
            stand_in_host(forwarding(hosts[0].url, before), release=released) as near:
        router = Router([near, hosts[1].url], workdir)
        try:
            router.wait(lambda h: h["hosts_up"] >= 2, "see both hosts up")
            yield router, hosts, near, slow
        finally:
            slow.clear()
            released.set()
            router.stop()


def test_lists_say_which_host_is_missing_and_the_widget_keeps_its_nodes(slow_link, comms):  # noqa: F811
    router, hosts, near, slow = slow_link
    Controller(hosts[0].url, hosts[0].token).create_snapshot("a", setup="me = 0")
    Controller(hosts[1].url, hosts[1].token).create_snapshot("b", setup="me = 1")
    api = Controller(router.url, router.token, timeout=60)
    kid_a = api.spawn_sandboxes("a", 1)[0]["id"]
    kid_b = api.spawn_sandboxes("b", 1)[0]["id"]
    whole = api.list_sandboxes()
    assert type(whole) is list and {s["id"] for s in whole} == {kid_a, kid_b}

    widget = LineageWidget(api, live=False)
    try:
        assert {kid_a, kid_b, "a", "b"} <= set(widget.tree)
        slow.set()
        part = api.list_sandboxes()
        assert isinstance(part, Partial) and [s["id"] for s in part] == [kid_b]
        assert list(part.missing_hosts) == [near]
        assert f"no answer to GET /v1/sandboxes within {HOST_TIMEOUT:g} s" == part.missing_hosts[near]

        async def async_list():
            async with AsyncController(router.url, router.token, timeout=60) as ctl:
                return await ctl.list_snapshots()

        snaps = asyncio.run(async_list())
        assert isinstance(snaps, Partial) and [s["tag"] for s in snaps] == ["b"] and list(snaps.missing_hosts) == [near]

        env = {**os.environ, "FORKD_URL": router.url, "FORKD_TOKEN": router.token}
        ls = subprocess.run([*FORKD, "ls"], env=env, capture_output=True, text=True, timeout=120)
        assert ls.returncode == 0 and kid_b in ls.stdout and kid_a not in ls.stdout, ls.stdout + ls.stderr
        assert f"forkd ls: host {near} did not answer (no answer to GET /v1/sandboxes within" in ls.stderr
        assert "what it holds is not listed" in ls.stderr
        kill = subprocess.run([*FORKD, "kill", "--tag", "a"], env=env, capture_output=True, text=True, timeout=120)
        assert f"forkd kill: host {near} did not answer" in kill.stderr, kill.stderr
        assert "is not killed: run this again when it answers" in kill.stderr
        listing = ForkdMagics(controller=api).forkd("ls --everyone")
        said = pretty(listing)
        assert kid_b in said and kid_a not in said
        assert f"⚠ {host_label(near)} did not answer (no answer to GET" in said and "not listed" in said
        assert "not listed" in listing._repr_html_()

        tree = widget.refresh()
        for key in (kid_a, "a"):  # the slow host's: drawn as last seen, not gone
            assert not tree[key].get("tomb") and tree[key]["status"] in ("running", "ready"), tree[key]
            assert tree[key]["unanswered"].startswith(f"{host_label(near)}: no answer to GET"), tree[key]
        assert "unanswered" not in tree[kid_b] and "unanswered" not in tree["b"]
        picture = static_svg(tree)  # what a notebook shows where the widget's JavaScript does not run
        assert f"{kid_a} · running · on {host_label(near)} · as last seen (its host did not answer)" in picture
        assert "gone" not in repr(widget)

        slow.clear()
        tree = widget.refresh()
        assert {kid_a, kid_b, "a", "b"} <= set(tree) and not any("unanswered" in n for n in tree.values())
        # a host that answers and no longer holds a node: that one is gone, as before
        api.kill_sandbox(kid_a)
        assert widget.refresh()[kid_a]["tomb"] is True
    finally:
        widget.close()
        api.kill_sandbox(kid_b)
