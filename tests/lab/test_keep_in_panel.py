"""The panel's "Keep this one" on a child of a fork tree (Debian's Chromium through Playwright): it
asks first, naming the siblings that go, then promotes; the siblings turn killed live, the winner
runs on and is no longer offered the action. A screenshot of the question and of the result."""

from __future__ import annotations

from .test_panel import LIVE_WITHIN, PANEL, row, shot


def test_keep_this_one_asks_then_promotes(page, lab):
    ctl = lab.controller()
    ctl.create_snapshot("kt", setup="x = 1")
    source = ctl.spawn_sandboxes("kt", 1)[0]["id"]
    tree = ctl.fork_sandbox(source, 3)
    kids = [k["id"] for k in tree["sandboxes"]]
    winner, losers = kids[1], [kids[0], kids[2]]
    for kid in kids:
        row(page, kid).wait_for(timeout=LIVE_WITHIN)

    row(page, source).click()  # not in a tree: nothing to keep
    assert page.locator(f"{PANEL} button.forkd-keep").count() == 0
    row(page, winner).click()
    keep = page.locator(f"{PANEL} button.forkd-keep")
    assert keep.text_content() == "Keep this one" and tree["fork_tree_id"] in keep.get_attribute("title")
    keep.click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=5_000)
    text = dialog.text_content()
    assert f"Keep {winner}?" in text and f"It wins fork tree {tree['fork_tree_id']}: 2 siblings are killed" in text
    assert all(loser in text for loser in losers)
    shot(page, "panel-keep-this-one-asks.png")
    dialog.locator(".jp-mod-reject").click()  # Cancel: nothing happens
    dialog.wait_for(state="detached", timeout=5_000)
    assert {b["id"] for b in ctl.list_sandboxes()} == {source, *kids}

    keep.click()
    dialog.wait_for(timeout=5_000)
    dialog.locator(".jp-mod-warn").click()
    for loser in losers:
        page.locator(f"{PANEL} .forkd-row[data-id='{loser}'][data-status='killed']").wait_for(timeout=LIVE_WITHIN)
    message = page.locator(f"{PANEL} .forkd-message")
    message.filter(has_text=f"kept {winner}: killed 2 siblings; released {tree['snapshot']['tag']}").wait_for(
        timeout=5_000)
    assert row(page, winner).get_attribute("data-status") == "running"
    assert {b["id"] for b in ctl.list_sandboxes()} == {source, winner}
    # the tree is closed: the winner (still selected) is a sandbox like any other now
    page.locator(f"{PANEL} button.forkd-keep").wait_for(state="detached", timeout=LIVE_WITHIN)
    assert page.locator(f"{PANEL} button.forkd-kill").count() == 1
    shot(page, "panel-keep-this-one-done.png")
