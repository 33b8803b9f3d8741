"""The panel names the host of each node when its tree spans hosts (a fleet's router), and says
nothing of hosts for one server; screenshots in the light and dark themes.

The panel reads its own Jupyter server's forkd extension, which cannot forward to a router: here the
browser's requests to ``{base}forkd/v1/...`` are answered by a real ``forkd router`` in front of two
real hosts (Playwright's request routing forwards them, with the router's token), so the tree the
panel draws is the router's own answer. Changes are not followed live that way (the event bus is
the Jupyter server's), so the test reads what the panel draws on opening.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from forkd_magics._static import host_label
from forkd_server.client import Controller

from ..fleet.fleet import fleet
from .test_panel import PANEL, row, shot


def forward_to(router):
    """A Playwright route handler: the request, made of the router instead, and its answer."""
    def handle(route, request):
        path = request.url.split("/forkd", 1)[1]
        req = urllib.request.Request(router.url + path, data=request.post_data_buffer, method=request.method,
                                     headers={"Authorization": f"Bearer {router.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, body, kind = r.status, r.read(), r.headers.get("Content-Type", "application/json")
        except urllib.error.HTTPError as exc:
            status, body, kind = exc.code, exc.read(), exc.headers.get("Content-Type", "application/json")
        route.fulfill(status=status, body=body, headers={"Content-Type": kind})
    return handle


def open_panel(browser, lab, router):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.route("**/forkd/v1/**", forward_to(router))
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


def test_the_panel_names_each_node_host_behind_a_router(browser, lab):
    with fleet(2) as (router, hosts):
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        direct[0].create_snapshot("left", setup="me = 0")
        direct[1].create_snapshot("right", setup="me = 1")
        api = Controller(router.url, router.token, timeout=120)
        lone = api.spawn_sandboxes("left", 1)[0]["id"]
        many = [k["id"] for k in api.spawn_sandboxes("right", 5)]
        names = [host_label(h.url) for h in hosts]

        context, page = open_panel(browser, lab, router)
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

            light = shot(page, "lab-panel-hosts-light.png")
            page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
            page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=10_000)
            page.wait_for_timeout(300)  # the theme's stylesheet has been applied once the attribute changed; let it paint
            dark = shot(page, "lab-panel-hosts-dark.png")
            page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
            page.wait_for_function("document.body.dataset.jpThemeLight === 'true'", timeout=10_000)
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
