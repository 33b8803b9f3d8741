"""A deep lineage in the sidebar at its default width (~300 px): every row stays within the pane with
its id's distinguishing end in view, and the details' values get the pane's width (label over value)
rather than wrapping a character at a time; at 600 px the facts sit beside their labels again."""

from __future__ import annotations

from .test_panel import PANEL, row, shot

LIVE_WITHIN = 5000  # ms


def sidebar_to(page, width: int) -> None:
    """Drag the sidebar's edge, as a person would, until the panel is `width` px wide."""
    now = page.evaluate(f"document.querySelector('{PANEL}').getBoundingClientRect().width")
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle").first.bounding_box()
    x, y = handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + width - now, y, steps=5)
    page.mouse.up()
    page.mouse.move(900, 450)
    got = page.evaluate(f"document.querySelector('{PANEL}').getBoundingClientRect().width")
    assert abs(got - width) <= 2, got


GEOMETRY = """([panel, id]) => {
    const canvas = document.querySelector(`${panel} .forkd-canvas`);
    const el = document.querySelector(`${panel} .forkd-row[data-id='${id}']`);
    el.scrollIntoView({ block: 'center' });
    canvas.scrollLeft = 0;  // as drawn, not scrolled sideways to it
    const c = canvas.getBoundingClientRect(), r = el.getBoundingClientRect();
    const tail = document.querySelector(`${panel} .forkd-row[data-id='${id}'] .forkd-id-tail`);
    const t = tail.getBoundingClientRect();
    const d = document.querySelector(`${panel} .forkd-details`);
    const cell = (name) => {
        const tr = [...d.querySelectorAll('tr')].find((x) => x.querySelector('th').textContent === name);
        const h = tr.querySelector('th').getBoundingClientRect(), v = tr.querySelector('td').getBoundingClientRect();
        return { thRight: h.right, thTop: h.top, tdLeft: v.left, tdTop: v.top, tdWidth: v.width };
    };
    return { visibleRight: c.left + canvas.clientLeft + canvas.clientWidth, rowLeft: r.left, rowRight: r.right,
             sideways: canvas.scrollWidth - canvas.clientWidth,
             tail: tail.textContent, tailRight: t.right, detailsWidth: d.clientWidth,
             notebook: cell('label notebook'), lineage: cell('lineage') };
}"""


def test_a_deep_lineage_reads_in_a_narrow_sidebar(page, lab):
    ctl = lab.controller()
    ctl.create_snapshot("deep-0", setup="x = 1")
    tag = "deep-0"
    for level in range(1, 6):  # snapshot, sandbox, snapshot, ...: deep-5 at depth 10, its sandbox at 11
        kid = ctl.spawn_sandboxes(tag, 1)[0]["id"]
        tag = f"deep-{level}-experiment"
        ctl.branch_sandbox(kid, tag, mode="live")
    deepest = ctl.spawn_sandboxes(tag, 1, labels={"notebook": "projects/analysis/a-deep-lineage.ipynb"})[0]["id"]
    row(page, deepest).wait_for(timeout=LIVE_WITHIN)
    assert page.locator(f"{PANEL} .forkd-row[data-id='{deepest}']").get_attribute("aria-level") == "12"
    row(page, deepest).click()
    page.locator(f"{PANEL} .forkd-details", has_text=f"sandbox {deepest}").wait_for(timeout=LIVE_WITHIN)
    for fact in ("label notebook", "lineage"):  # the facts measured below, once the pane has drawn them
        page.locator(f"{PANEL} .forkd-details th", has_text=fact).first.wait_for(timeout=LIVE_WITHIN)

    sidebar_to(page, 300)
    g = page.evaluate(GEOMETRY, [PANEL, deepest])
    # the row, its right edge included, is in view with nothing to scroll sideways, and so is its id's end
    assert g["sideways"] <= 0 and g["rowRight"] <= g["visibleRight"] + 0.5, g
    assert g["tail"] == deepest[-7:] and g["tailRight"] <= g["rowRight"], g
    # the values take the pane's width under their labels, not a sliver beside the longest label
    for fact in ("notebook", "lineage"):
        assert g[fact]["tdWidth"] >= 0.8 * g["detailsWidth"], g
        assert g[fact]["tdTop"] > g[fact]["thTop"], g
    shot(page, "lab-deep-lineage-300.png")

    sidebar_to(page, 600)
    g = page.evaluate(GEOMETRY, [PANEL, deepest])
    assert g["rowRight"] <= g["visibleRight"] + 0.5, g
    for fact in ("notebook", "lineage"):  # wide: each value beside its label, as a table
        assert g[fact]["tdLeft"] >= g[fact]["thRight"] and abs(g[fact]["tdTop"] - g[fact]["thTop"]) < 2, g
    shot(page, "lab-deep-lineage-600.png")
