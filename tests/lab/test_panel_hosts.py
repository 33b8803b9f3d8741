"""The panel names the host of each node when its tree spans hosts (a fleet's router), and says
nothing of hosts for one server; screenshots in the light and dark themes.

Behind a router the panel is a real JupyterLab in remote mode: ``FORKD_URL`` and ``FORKD_TOKEN`` in
its environment, as a JupyterHub spawner sets them, so its own ``{base}forkd/v1/...`` passes every
read on to a real ``forkd router`` in front of two real hosts, and the router's events reach the
panel through the Jupyter server's event bus (a child spawned through the router shows at once).
"""

from __future__ import annotations

import os
import shutil

import pytest

from forkd_magics._static import host_label
from forkd_server.client import Controller

from ..fleet.fleet import fleet
from .conftest import new_lab
from .test_panel import LIVE_WITHIN, PANEL, row, set_theme, shot

POLL_EVERY = 15_000  # ms: the panel re-reads the tree this often on its own; a change seen sooner came as an event


@pytest.fixture(scope="module")
def fleet_lab(lab_venv):
    """(lab, router, hosts): a JupyterLab whose forkd routes pass on to a router of two hosts."""
    if os.geteuid() != 0:
        pytest.skip("the process engine needs root")
    with fleet(2) as (router, hosts):
        lab = new_lab(lab_venv, FORKD_URL=router.url, FORKD_TOKEN=router.token)
        try:
            lab.start()
            yield lab, router, hosts
        finally:
            lab.stop()
            assert not os.listdir(lab.data_dir), "remote mode made a forkd of its own"
            shutil.rmtree(lab.root, ignore_errors=True)
            shutil.rmtree(lab.data_dir, ignore_errors=True)


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
    lab, router, hosts = fleet_lab
    direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
    direct[0].create_snapshot("left", setup="me = 0")
    direct[1].create_snapshot("right", setup="me = 1")
    api = Controller(router.url, router.token, timeout=120)
    lone = api.spawn_sandboxes("left", 1)[0]["id"]
    many = [k["id"] for k in api.spawn_sandboxes("right", 5)]
    names = [host_label(h.url) for h in hosts]

    context, page = open_panel(browser, lab)
    try:
        row(page, lone).wait_for(timeout=30_000)
        assert page.locator(f"{PANEL} .forkd-head").text_content().startswith("2 snapshots · 6 sandboxes · 2 hosts")
        assert host_chip(page, "left").text_content() == names[0]
        assert host_chip(page, "right").text_content() == names[1]
        assert host_chip(page, lone).text_content() == names[0]
        assert host_chip(page, lone).get_attribute("title") == f"on host {hosts[0].url}"
        assert f"on {names[0]}" in row(page, lone).get_attribute("aria-label")
        # five alike children fold into one row, which says where they are
        group = page.locator(f"{PANEL} .forkd-group[data-count='5']")
        assert f"on {names[1]}" in group.text_content()
        # the details say the host in full; the search finds nodes by their host
        row(page, lone).click()
        page.locator(f"{PANEL} .forkd-details tr", has_text="host").filter(has_text=hosts[0].url).wait_for(
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
