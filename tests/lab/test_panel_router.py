"""The panel in a JupyterLab that is itself the fleet's router (the extension's router mode,
``c.ForkdApp.router_hosts``), over two real ``forkd serve`` hosts and no ``forkd router``: the panel,
unchanged, names the host of each node, shows a child spawned through the server at once (the
router's events reach it through the server's event bus), and its kill reaches the sandbox's host;
a notebook on the forkd kernel runs on the hosts and the panel's Check out moves it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from forkd_magics._static import host_label
from forkd_server.client import Controller

from ..fleet.fleet import fleet
from .conftest import CONFIG, new_lab
from .test_panel import LIVE_WITHIN, PANEL, new_forkd_notebook, row, run_cell
from .test_panel_hosts import POLL_EVERY, host_chip, open_panel


@pytest.fixture(scope="module")
def router_lab(lab_venv):
    """(lab, hosts): a JupyterLab in router mode over two hosts."""
    if os.geteuid() != 0:
        pytest.skip("the process engine needs root")
    with fleet(2, router=False) as (workdir, hosts):
        lab = new_lab(lab_venv)
        Path(lab.root, "lab_config.py").write_text(
            CONFIG + f"c.ForkdApp.router_hosts = {[h.url for h in hosts]!r}\n"
                     f"c.ForkdApp.router_hosts_token_file = {os.path.join(workdir, 'token')!r}\n")
        try:
            lab.start()
            deadline = time.monotonic() + 60
            while lab.controller().healthz().get("hosts_up") != 2:  # bounded polling: its first heartbeats
                assert time.monotonic() < deadline, Path(lab.root, "lab.log").read_text()[-3000:]
                time.sleep(0.05)
            yield lab, hosts
        finally:
            lab.stop()
            assert os.listdir(lab.data_dir) == ["router"], "router mode ran a forkd of its own"
            shutil.rmtree(lab.root, ignore_errors=True)
            shutil.rmtree(lab.data_dir, ignore_errors=True)


def test_the_panel_of_a_lab_in_router_mode_shows_and_acts_on_the_fleet(browser, router_lab):
    lab, hosts = router_lab
    direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
    direct[0].create_snapshot("left", setup="me = 0")
    direct[1].create_snapshot("right", setup="me = 1")
    api = lab.controller()
    lone = api.spawn_sandboxes("left", 1)[0]["id"]
    pair = [k["id"] for k in api.spawn_sandboxes("right", 2)]
    names = [host_label(h.url) for h in hosts]

    context, page = open_panel(browser, lab)
    try:
        row(page, lone).wait_for(timeout=30_000)
        assert page.locator(f"{PANEL} .forkd-head").text_content().startswith("2 snapshots · 3 sandboxes · 2 hosts")
        assert host_chip(page, "left").text_content() == names[0]
        assert host_chip(page, "right").text_content() == names[1]
        assert host_chip(page, lone).get_attribute("title") == f"on host {hosts[0].url}"

        # live: a child spawned through this server shows before the panel's own re-read could bring it
        late = api.spawn_sandboxes("left", 1)[0]["id"]
        row(page, late).wait_for(timeout=min(LIVE_WITHIN * 5, POLL_EVERY - 1000))
        assert host_chip(page, late).text_content() == names[0]

        # the panel's kill: confirmed, it reaches the host, and the row is marked killed
        row(page, late).click()
        page.locator(f"{PANEL} button.forkd-kill").click()
        dialog = page.locator(".jp-Dialog")
        dialog.wait_for(timeout=5_000)
        dialog.locator(".jp-mod-warn").click()
        page.locator(f"{PANEL} .forkd-row[data-id='{late}'][data-status='killed']").wait_for(timeout=LIVE_WITHIN * 5)
        assert late not in {s["id"] for s in direct[0].list_sandboxes()}
    finally:
        context.close()
    for k in [lone, *pair]:
        api.kill_sandbox(k)
    for d, tag in zip(direct, ("left", "right")):
        d.delete_snapshot(tag)


def test_a_forkd_notebook_in_a_lab_in_router_mode_checks_out_from_the_panel(browser, router_lab):
    """A notebook on the forkd kernel finds the server with no setup and its HEAD is on a host; the
    panel's branch and Check out act on the fleet, and the next cell runs in the child."""
    lab, hosts = router_lab
    api = lab.controller()
    context, page = open_panel(browser, lab)
    try:
        first = new_forkd_notebook(page)  # its HEAD, marked in the panel once the kernel recorded it
        assert {s["id"]: s["host"] for s in api.list_sandboxes()}[first] in {h.url for h in hosts}
        assert run_cell(page, "x = 41; x") == "41"
        name = page.evaluate("window.jupyterapp.shell.currentWidget.context.path")
        page.evaluate("window.jupyterapp.commands.execute('forkd:branch-notebook')")
        page.locator(".jp-toast-message", has_text=f"Branched {name}").wait_for(timeout=30_000)
        branch = next(s["tag"] for s in api.list_snapshots() if s.get("branched_from") == first)
        kid = api.spawn_sandboxes(branch, 1)[0]["id"]
        api.run_code(kid, "x = 99")
        row(page, kid).wait_for(timeout=LIVE_WITHIN * 5)

        row(page, kid).click()
        page.locator(f"{PANEL} button.forkd-checkout").click()
        page.locator(".jp-toast-message", has_text=f"Checked out {kid}").wait_for(timeout=30_000)
        page.locator(f"{PANEL} .forkd-node[data-id='{kid}'] .forkd-head-chip").wait_for(timeout=LIVE_WITHIN * 5)
        assert run_cell(page, "x + 1") == "100"
        page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
    finally:
        context.close()
    for s in api.list_sandboxes():
        api.kill_sandbox(s["id"])
    for s in sorted(api.list_snapshots(), key=lambda s: -len(s.get("lineage", []))):
        api.delete_snapshot(s["tag"])
