"""The lineage widget's "Keep this one" in JupyterLab (Debian's Chromium): a notebook forks a
sandbox into a fork tree and draws the tree; the button asks in the widget, then promotes, and the
siblings turn killed live. Screenshot: ``build/screenshots/widget-keep-this-one.png``."""

from __future__ import annotations

import os

import nbformat

from .test_browser import CHROMIUM, CHROMIUM_ARGS, SHOTS, lab, open_in_lab, playwright_sync, pytestmark  # noqa: F401

CELLS = ["%load_ext forkd_magics", "%forkd snapshot -t kwb", "src = %forkd fork -t kwb -n 1",
         "kids = %forkd fork src[0] -n 3", "%forkd tree"]


def test_the_widgets_keep_this_one(lab, forkd):  # noqa: F811
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, os.path.join(lab["root"], "keep.ipynb"))
    ctl = forkd.controller()
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            open_in_lab(page, lab, "keep.ipynb")
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            widget = page.locator(".jp-OutputArea .forkd-lineage")
            widget.wait_for(timeout=120_000)
            tree = [b for b in ctl.list_sandboxes() if b["labels"].get("fork_tree_id")]
            assert len(tree) == 3
            kids = sorted(b["id"] for b in tree)
            for kid in kids:
                widget.locator(f".forkd-node[data-id='{kid}'][data-status='running']").wait_for(timeout=30_000)
            widget.locator(f".forkd-node[data-id='{kids[1]}']").click()
            widget.locator("button.forkd-keep").click()
            confirm = widget.locator(".forkd-confirm")
            confirm.wait_for(timeout=10_000)
            assert f"Keep {kids[1]}?" in confirm.text_content() and "2 sibling(s) killed" in confirm.text_content()
            confirm.locator("button.forkd-confirm-ok").click()
            widget.locator(".forkd-message", has_text=f"kept {kids[1]}: killed 2 siblings").wait_for(timeout=30_000)
            for loser in (kids[0], kids[2]):
                widget.locator(f".forkd-node[data-id='{loser}'][data-status='killed']").wait_for(timeout=30_000)
            assert {b["id"] for b in ctl.list_sandboxes()} & set(kids) == {kids[1]}
            widget.locator("button.forkd-keep").wait_for(state="detached", timeout=30_000)  # the tree closed
            widget.scroll_into_view_if_needed()
            page.mouse.move(5, 5)
            SHOTS.mkdir(parents=True, exist_ok=True)
            widget.screenshot(path=str(SHOTS / "widget-keep-this-one.png"))
        except BaseException:
            page.screenshot(path=str(SHOTS / "failure-widget-keep.png"))
            raise
        finally:
            browser.close()
