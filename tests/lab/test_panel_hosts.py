"""The panel names the host of each node when its tree spans hosts (a fleet's router), and says
nothing of hosts for one server; a host too slow for the router's merged tree keeps its nodes drawn
as last seen, said so, instead of vanishing; screenshots in the light and dark themes.

Behind a router the panel is a real JupyterLab in remote mode: ``FORKD_URL`` and ``FORKD_TOKEN`` in
its environment, as a JupyterHub spawner sets them, so its own ``{base}forkd/v1/...`` passes every
read on to a real ``forkd router`` in front of two real hosts, and the router's events reach the
panel through the Jupyter server's event bus (a child spawned through the router shows at once).
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, field

import pytest

from forkd_magics._static import host_label
from forkd_server.client import Controller

from ..fleet.fleet import HOST_TIMEOUT, Router, fleet, forwarding, stand_in_host, wait_for
from .conftest import new_lab
from .test_panel import LIVE_WITHIN, PANEL, row, set_theme, shot

POLL_EVERY = 15_000  # ms: the panel re-reads the tree this often on its own; a change seen sooner came as an event


@dataclass
class Link:
    """The router's link to the first host, as a test makes it: once ``slow`` is set, the host's
    answers to ``GET /v1/tree`` wait (until ``released``, at most 30 s), longer than the router waits
    for a host's part of the merged tree; its heartbeat and every other call pass at once."""

    slow: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def before(self, method: str, path: str) -> None:
        if method == "GET" and path.startswith("/v1/tree") and self.slow.is_set():
            self.released.wait(30)


@dataclass
class FleetLab:
    lab: object
    router: Router
    hosts: list       # the hosts' servers (their own URLs, for direct calls)
    urls: list[str]   # the URLs the router knows them by (the first through ``link``)
    link: Link


@pytest.fixture(scope="module")
def fleet_lab(lab_venv):
    """A JupyterLab whose forkd routes pass on to a router of two hosts, the first behind ``link``."""
    if os.geteuid() != 0:
        pytest.skip("the process engine needs root")
    link = Link()
    with fleet(2, router=False) as (workdir, hosts), \
            stand_in_host(forwarding(hosts[0].url, link.before), release=link.released) as near:
        router = Router([near, hosts[1].url], workdir)
        lab = None
        try:
            router.wait(lambda h: h["hosts_up"] >= 2, "see both hosts up")
            lab = new_lab(lab_venv, FORKD_URL=router.url, FORKD_TOKEN=router.token)
            lab.start()
            yield FleetLab(lab, router, hosts, [near, hosts[1].url], link)
        finally:
            if lab is not None:
                lab.stop()
                assert not os.listdir(lab.data_dir), "remote mode made a forkd of its own"
                shutil.rmtree(lab.root, ignore_errors=True)
                shutil.rmtree(lab.data_dir, ignore_errors=True)
            router.stop()


def open_panel(browser, lab):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(f"{lab.url}/lab?reset")
    page.wait_for_function("window.jupyterapp && window.jupyterapp.commands.hasCommand('forkd:open-lineage')",
                           timeout=60_000)
    page.evaluate("window.jupyterapp.restored")
    page.evaluate("window.jupyterapp.commands.execute('forkd:open-lineage')")
    page.locator(f"{PANEL} .forkd-lineage").wait_for(timeout=30_000)
    return context, page


def host_chip(page, key):
    return page.locator(f"{PANEL} .forkd-row[data-key='{key}'] .forkd-host")


def test_the_panel_names_each_node_host_behind_a_router(browser, fleet_lab):
    lab, router, hosts, urls = fleet_lab.lab, fleet_lab.router, fleet_lab.hosts, fleet_lab.urls
    direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
    direct[0].create_snapshot("left", setup="me = 0")
    direct[1].create_snapshot("right", setup="me = 1")
    api = Controller(router.url, router.token, timeout=120)
    lone = api.spawn_sandboxes("left", 1)[0]["id"]
    many = [k["id"] for k in api.spawn_sandboxes("right", 5)]
    names = [host_label(u) for u in urls]

    context, page = open_panel(browser, lab)
    try:
        row(page, lone).wait_for(timeout=30_000)
        assert page.locator(f"{PANEL} .forkd-head").text_content().startswith("2 snapshots · 6 sandboxes · 2 hosts")
        assert host_chip(page, "left").text_content() == names[0]
        assert host_chip(page, "right").text_content() == names[1]
        assert host_chip(page, lone).text_content() == names[0]
        assert host_chip(page, lone).get_attribute("title") == f"on host {urls[0]}"
        assert f"on {names[0]}" in row(page, lone).get_attribute("aria-label")
        # five alike children fold into one row, which says where they are
        group = page.locator(f"{PANEL} .forkd-group[data-count='5']")
        assert f"on {names[1]}" in group.text_content()
        # the details say the host in full; the search finds nodes by their host
        row(page, lone).click()
        page.locator(f"{PANEL} .forkd-details tr", has_text="host").filter(has_text=urls[0]).wait_for(
            timeout=5_000)
        page.locator(f"{PANEL} .forkd-search").fill(names[1])
        page.wait_for_function(f"document.querySelectorAll('{PANEL} .forkd-row').length === 6")  # right, its five
        assert row(page, lone).count() == 0 and row(page, "left").count() == 0
        page.locator(f"{PANEL} .forkd-search").fill("")
        row(page, lone).wait_for(timeout=5_000)

        # live: a child spawned through the router shows before the panel's own re-read could bring it
        late = api.spawn_sandboxes("left", 1)[0]["id"]
        many.append(late)
        row(page, late).wait_for(timeout=min(LIVE_WITHIN * 5, POLL_EVERY - 1000))
        assert host_chip(page, late).text_content() == names[0]
        assert page.locator(f"{PANEL} .forkd-head").text_content().startswith("2 snapshots · 7 sandboxes · 2 hosts")

        light = shot(page, "lab-panel-hosts-light.png")
        set_theme(page, dark=True)
        dark = shot(page, "lab-panel-hosts-dark.png")
        set_theme(page, dark=False)
        assert light.read_bytes() != dark.read_bytes()
    finally:
        context.close()
    for k in [lone, *many]:
        api.kill_sandbox(k)


def test_a_host_too_slow_for_the_tree_keeps_its_nodes_drawn_as_last_seen(browser, fleet_lab):
    lab, router, hosts, urls, link = fleet_lab.lab, fleet_lab.router, fleet_lab.hosts, fleet_lab.urls, fleet_lab.link
    Controller(hosts[0].url, hosts[0].token, timeout=120).create_snapshot("near", setup="me = 0")
    Controller(hosts[1].url, hosts[1].token, timeout=120).create_snapshot("far", setup="me = 1")
    api = Controller(router.url, router.token, timeout=120)
    near = api.spawn_sandboxes("near", 1)[0]["id"]
    made = [near]
    context, page = open_panel(browser, lab)
    state_line = page.locator(f"{PANEL} .forkd-state")
    try:
        row(page, near).wait_for(timeout=30_000)
        assert row(page, near).get_attribute("class").split().count("forkd-unanswered") == 0
        link.slow.set()
        # a spawn on the other host is an event: the panel reads the tree again, and the router's
        # merged answer comes without the first host's part after its host timeout
        made.append(api.spawn_sandboxes("far", 1)[0]["id"])
        stale = page.locator(f"{PANEL} .forkd-row.forkd-unanswered[data-key='{near}']")
        stale.wait_for(timeout=(HOST_TIMEOUT + 20) * 1000)
        assert page.locator(f"{PANEL} .forkd-row.forkd-unanswered[data-key='near']").count() == 1
        assert "as last seen" in row(page, near).get_attribute("aria-label")
        assert row(page, made[1]).get_attribute("class").split().count("forkd-unanswered") == 0
        said = state_line.text_content()
        assert f"{host_label(urls[0])}: no answer to GET /v1/tree within" in said, said
        assert "what it holds is drawn as last seen" in said, said
        assert router.hosts()[urls[0]]["state"] == "up"  # its heartbeat answers: slow, not down
        row(page, near).click()
        page.locator(f"{PANEL} .forkd-details tr", has_text="its host did not answer").wait_for(timeout=5_000)
        shot(page, "lab-panel-host-unanswered.png")
        # the host answers again: the next read draws its nodes as they are, and the line goes
        link.slow.clear()
        link.released.set()
        api.kill_sandbox(made.pop())
        page.locator(f"{PANEL} .forkd-unanswered").first.wait_for(state="detached", timeout=(HOST_TIMEOUT + 20) * 1000)
        row(page, near).wait_for(timeout=5_000)
        wait_for(lambda: not state_line.is_visible() or "last seen" not in state_line.text_content(),
                 "the state line to stop naming the host", timeout=10)
    finally:
        link.slow.clear()
        link.released.set()
        context.close()
        for k in made:
            api.kill_sandbox(k)
        link.released.clear()


def test_the_panel_names_no_host_for_one_server(page, lab):
    ctl = lab.controller()
    ctl.create_snapshot("solo", setup="pass")
    kid = ctl.spawn_sandboxes("solo", 1)[0]["id"]
    row(page, kid).wait_for(timeout=10_000)
    assert page.locator(f"{PANEL} .forkd-host").count() == 0
    assert "host" not in page.locator(f"{PANEL} .forkd-head").text_content()
    row(page, kid).click()
    page.locator(f"{PANEL} .forkd-details", has_text=f"sandbox {kid}").wait_for(timeout=5_000)
    assert page.locator(f"{PANEL} .forkd-details th", has_text="host").count() == 0
