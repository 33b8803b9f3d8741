"""Headless Chromium (Debian's) opens the quickstart in JupyterLab, runs it, and photographs the
lineage widget after the branch it shows went ``writing`` -> ``ready`` live.

The screenshot goes to ``build/screenshots/quickstart-lineage.png`` (``$FORKD_SCREENSHOT_DIR``
to change the folder), with the whole page next to it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from .conftest import free_port

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).parents[2]
SHOTS = Path(os.environ.get("FORKD_SCREENSHOT_DIR") or REPO / "build" / "screenshots")

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]

playwright_sync = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="Debian's chromium is not installed (scripts/setup.sh test installs it)")


@pytest.fixture
def lab(forkd):
    """JupyterLab on a copy of the quickstart (outputs cleared), its kernels pointed at ``forkd``."""
    root = tempfile.mkdtemp(prefix="fklab")
    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, os.path.join(root, "quickstart.ipynb"))
    # no "would you like news?" toast over the widget
    settings = Path(root, "settings", "@jupyterlab", "apputils-extension")
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    token, port = os.urandom(12).hex(), free_port()
    log = open(os.path.join(root, "lab.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
         "--ServerApp.port_retries=0", f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}",
         f"--LabApp.workspaces_dir={root}/ws", f"--LabApp.user_settings_dir={root}/settings",
         "--ServerApp.disable_check_xsrf=True", "--LabApp.expose_app_in_browser=True"],
        # a data dir of its own: one server per data dir, and the kernels use `forkd` anyway
        env={**forkd.env, "JUPYTER_RUNTIME_DIR": os.path.join(root, "rt"), "FORKD_DATA_DIR": os.path.join(root, "fd")},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:  # bounded polling of the server's status route
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.flush()
            pytest.fail("jupyter lab did not start:\n" + Path(root, "lab.log").read_text()[-3000:])
        time.sleep(0.1)
    try:
        yield {"url": url, "token": token, "root": root, "cells": nb.cells}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def test_quickstart_in_jupyterlab_shows_branch_going_ready(lab, forkd):
    cells = lab["cells"]
    before_cleanup = next(i for i, c in enumerate(cells) if "cleanup" in c.metadata.get("tags", []))
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / "quickstart-lineage.png"
    for old in (shot, SHOTS / "quickstart-page.png"):
        old.unlink(missing_ok=True)
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab['url']}/lab/tree/quickstart.ipynb?token={lab['token']}")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
            # the kernel is up once the status bar says so
            page.wait_for_function("document.body.innerText.includes('(ipykernel) | Idle')", timeout=60_000)
            # run every cell up to the clean-up, as a person would: Shift+Enter from the top; the
            # first code cell alone, until its prompt shows it ran, then the rest
            page.locator(".jp-NotebookPanel .jp-Cell").first.click()
            page.keyboard.press("Escape")
            first_code = next(i for i, c in enumerate(cells) if c.cell_type == "code")
            for _ in range(first_code + 1):
                page.keyboard.press("Shift+Enter")
            page.locator(".jp-NotebookPanel .jp-InputPrompt", has_text="[1]:").wait_for(timeout=60_000)
            for _ in range(before_cleanup - first_code - 1):
                page.keyboard.press("Shift+Enter")
            widget = page.locator(".jp-OutputArea .forkd-lineage")  # the widget, not the lab panel's
            widget.wait_for(timeout=60_000)
            branch = widget.locator(".forkd-node[data-id='quickstart-b1'][data-status='ready']")
            branch.wait_for(timeout=60_000)
            # the last cell before the clean-up ran (the listing shows the grandchildren)
            page.get_by_text("5 sandbox(es)").first.wait_for(timeout=60_000)
            badge = branch.locator(".forkd-badge").text_content()
            assert badge == "writing → ready"  # the live stream carried both states to the page
            # the tree cell ran before the branch existed: the node arrived without re-running it
            tree_cell = next(i for i, c in enumerate(cells) if c.source.startswith("tree = %forkd tree"))
            assert tree_cell < next(i for i, c in enumerate(cells) if "%forkd branch" in c.source)
            ids = widget.locator(".forkd-node").evaluate_all("els => els.map(e => e.dataset.id)")
            assert len(ids) == 2 + 5 and "quickstart" in ids
            # click shows details and the actions
            branch.click()
            details = widget.locator(".forkd-details")
            assert "snapshot quickstart-b1" in details.text_content()
            assert "writing → ready" in details.text_content()
            assert widget.locator("button.forkd-fork").count() == 1
            assert widget.locator("button.forkd-delete").count() == 1
            widget.scroll_into_view_if_needed()
            page.mouse.move(5, 5)  # no hover highlight in the picture
            widget.screenshot(path=str(shot))
            page.screenshot(path=str(SHOTS / "quickstart-page.png"), full_page=False)
            # a button goes page -> kernel -> server, and the new sandboxes come back over the events;
            # four alike grandchildren now fold into one row, which a click lists
            widget.locator("input.forkd-n").fill("2")
            widget.locator("button.forkd-fork").click()
            widget.locator(".forkd-message", has_text="forked 2 sandboxes from quickstart-b1").wait_for(timeout=30_000)
            group = widget.locator(".forkd-group[data-count='4'][data-status='running']")
            group.wait_for(timeout=30_000)
            assert widget.locator(".forkd-node").count() == 2 + 3  # the snapshots and the three kids
            group.click()
            page.wait_for_function(
                "document.querySelectorAll('.jp-OutputArea .forkd-lineage .forkd-node').length === 9", timeout=30_000)
            # the kernel that drew the widget restarts: the view says so, and its buttons stay off
            # (nothing waits on a kernel that will never answer)
            page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()")
            widget.locator(".forkd-state[data-state='disconnected']").wait_for(timeout=10_000)
            assert "run the cell again" in widget.locator(".forkd-state").text_content()
            assert widget.locator("button.forkd-delete").is_disabled()  # quickstart-b1 is still selected
        except BaseException:
            page.screenshot(path=str(SHOTS / "failure-page.png"))
            raise
        finally:
            browser.close()
    assert shot.stat().st_size > 5000
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # what the page showed is what the server has
    snaps = {s["tag"]: s for s in forkd.controller().list_snapshots()}
    assert snaps["quickstart-b1"]["status"] == "ready"
    from_branch = [b for b in forkd.controller().list_sandboxes() if b["snapshot_tag"] == "quickstart-b1"]
    assert len(from_branch) == 4  # two from the notebook, two from the button


def open_in_lab(page, lab, name: str) -> None:
    page.goto(f"{lab['url']}/lab/tree/{name}?token={lab['token']}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    page.wait_for_function("document.body.innerText.includes('(ipykernel) | Idle')", timeout=60_000)


def theme(page, name: str) -> None:
    page.evaluate(f"window.jupyterapp.commands.execute('apputils:change-theme', {{theme: 'JupyterLab {name}'}})")
    page.wait_for_function(f"document.body.dataset.jpThemeLight === '{str(name == 'Light').lower()}'", timeout=10_000)
    page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=10_000)


def test_run_all_leaves_the_whole_tree_drawn_even_in_a_view_drawn_afterwards(lab, forkd):
    """Run All reaches the clean-up before the page has drawn the tree: the tree must still show
    every node the notebook made, marked killed or deleted (the kernel keeps them, not the page),
    and a view drawn later (the page reloaded, the kernel still running) shows the same."""
    gone = {"quickstart": "deleted", "quickstart-b1": "deleted"}
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            open_in_lab(page, lab, "quickstart.ipynb")
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            last = len(lab["cells"]) - 1
            page.wait_for_function(  # the clean-up cell ran: its prompt has a number
                "i => /\\[\\d+\\]/.test(document.querySelectorAll('.jp-NotebookPanel .jp-Cell')[i]"
                ".querySelector('.jp-InputPrompt').textContent)", arg=last, timeout=180_000)
            made = {s["id"]: "killed" for s in forkd.controller().list_sandboxes()}
            assert made == {}  # the notebook cleaned up after itself
            for reloaded in (False, True):
                if reloaded:  # the models come back from the kernel: a view drawn after the clean-up
                    page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
                    page.wait_for_function("!window.jupyterapp.shell.currentWidget.context.model.dirty")
                    page.reload()
                    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
                widget = page.locator(".jp-OutputArea .forkd-lineage")
                widget.wait_for(timeout=60_000)
                for tag, status in gone.items():
                    widget.locator(f".forkd-node[data-id='{tag}'][data-status='{status}']").wait_for(timeout=30_000)
                page.wait_for_function(
                    "document.querySelectorAll(\".jp-OutputArea .forkd-lineage .forkd-node[data-status='killed']\")"
                    ".length === 5", timeout=30_000)  # 3 kids and 2 grandchildren
                assert widget.locator(".forkd-node").count() == 7
                assert widget.locator(".forkd-head").text_content().startswith("0 snapshots · 0 sandboxes")
                assert widget.locator("button", has_text="clear gone (7)").is_visible()
                assert "running → killed" in widget.locator(".forkd-node.sandbox").first.text_content()
            widget.scroll_into_view_if_needed()
            page.mouse.move(5, 5)
            widget.screenshot(path=str(SHOTS / "run-all-tree-light.png"))
            theme(page, "Dark")
            widget.screenshot(path=str(SHOTS / "run-all-tree-dark.png"))
            theme(page, "Light")
            # "clear gone" asks the kernel to forget them: nothing is left to draw
            widget.locator("button", has_text="clear gone (7)").click()
            widget.locator(".forkd-empty").wait_for(timeout=10_000)
            assert widget.locator(".forkd-node").count() == 0
        except BaseException:
            page.screenshot(path=str(SHOTS / "failure-run-all.png"))
            raise
        finally:
            browser.close()


def test_a_stored_notebook_shows_its_static_picture_of_the_tree(lab, forkd):
    """The quickstart as this repository stores it (run by nbconvert, not signed: JupyterLab treats
    its outputs as untrusted and renders only through its safe renderers) shows the tree's picture,
    not the widget's text, ``LineageWidget(...)``."""
    shutil.copy(REPO / "notebooks" / "quickstart.ipynb", os.path.join(lab["root"], "stored.ipynb"))
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            open_in_lab(page, lab, "stored.ipynb")
            cell = page.locator(".jp-NotebookPanel .jp-CodeCell", has_text="tree = %forkd tree")
            picture = cell.locator(".jp-OutputArea-output img[src^='data:image/svg+xml;base64,']")
            picture.wait_for(timeout=30_000)
            page.wait_for_function("img => img.complete && img.naturalWidth === 600", arg=picture.element_handle(),
                                   timeout=10_000)
            assert picture.get_attribute("alt").startswith("forkd lineage: 1 snapshot(s), 3 sandbox(es)")
            assert "LineageWidget(" not in cell.locator(".jp-OutputArea").text_content()
            picture.scroll_into_view_if_needed()
            page.mouse.move(5, 5)
            cell.locator(".jp-OutputArea").screenshot(path=str(SHOTS / "stored-tree-light.png"))
            theme(page, "Dark")
            cell.locator(".jp-OutputArea").screenshot(path=str(SHOTS / "stored-tree-dark.png"))
        except BaseException:
            page.screenshot(path=str(SHOTS / "failure-stored.png"))
            raise
        finally:
            browser.close()
