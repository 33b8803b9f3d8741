"""The panel shows each sandbox's tier (frozen, stored) and each snapshot kept in the store, live
from the event bus, in its rows and its details; a screenshot of it for a person to look at."""

from __future__ import annotations

import pytest

from .test_panel import PANEL, row, shot

LIVE_WITHIN = 5000  # ms: the tier event reaches the panel without a reload

pytestmark = pytest.mark.slow  # a VM snapshot (TCG) and a stored VM sandbox


def chip(page, key, text):
    return page.locator(f"{PANEL} .forkd-row[data-key='{key}'] .forkd-chip", has_text=text)


def test_tiers_and_stored_snapshots_show_in_the_panel(page, lab):
    ctl = lab.controller()
    ctl.create_snapshot("proc", setup="x = 1")
    kid = ctl.spawn_sandboxes("proc", 1)[0]["id"]
    row(page, kid).wait_for(timeout=LIVE_WITHIN)
    ctl.freeze_sandbox(kid)
    chip(page, kid, "frozen").wait_for(timeout=LIVE_WITHIN)
    assert "frozen" in row(page, kid).get_attribute("aria-label")

    # a VM snapshot is kept in the local store once ready: its row says stored
    ctl.create_snapshot("vm", engine="vm", mem_size_mib=192, setup="y = 2", timeout=900)
    chip(page, "vm", "stored").wait_for(timeout=60_000)
    vm_kid = ctl.spawn_sandboxes("vm", 1)[0]["id"]
    row(page, vm_kid).wait_for(timeout=LIVE_WITHIN)
    ctl.store_sandbox(vm_kid)
    chip(page, vm_kid, "stored").wait_for(timeout=LIVE_WITHIN)
    row(page, vm_kid).click()
    details = page.locator(f"{PANEL} .forkd-details")
    details.locator("tr", has_text="tier").filter(has_text="stored").wait_for(timeout=LIVE_WITHIN)
    shot(page, "panel-tiers.png")

    # a call wakes both: their chips go
    assert ctl.eval_code(kid, "x")["result"] == "1"
    assert ctl.eval_code(vm_kid, "y")["result"] == "2"
    chip(page, kid, "frozen").wait_for(state="detached", timeout=LIVE_WITHIN)
    chip(page, vm_kid, "stored").wait_for(state="detached", timeout=LIVE_WITHIN)
