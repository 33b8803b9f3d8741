"""The README's notebook commands, as written there: each ```python block of its "In a notebook"
section runs as one cell, in order, in a real shell against ``forkd serve``, comments and all."""

from __future__ import annotations

import re
from pathlib import Path

from forkd_magics import LineageWidget

from .conftest import cell, in_notebook

README = Path(__file__).parents[2] / "README.md"


def notebook_cells() -> list[str]:
    text = README.read_text()
    section = text[text.index("\n## In a notebook\n"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_has_notebook_commands_with_comments():
    cells = notebook_cells()
    assert len(cells) >= 4 and cells[0].startswith("%load_ext forkd_magics")
    assert sum("%forkd" in line and "#" in line for c in cells for line in c.splitlines()) >= 5


def test_the_readme_notebook_commands_run_as_written(ip, forkd):
    in_notebook(ip, "readme-kernel", "README.ipynb")
    widgets, checked = [], []
    try:
        for source in notebook_cells():
            res, out = cell(ip, source)
            assert res.success, f"{source}\n{out.stdout}\n{out.stderr}"
            if isinstance(res.result, LineageWidget):
                widgets.append(res.result)
            if source.startswith("%%forkd run kids"):
                checked.append("run")
                assert [ex.text for ex in res.result.values()] == ["np.float64(20000000.0)"] * 4
            if "%forkd tree" in source:
                checked.append("tree")
                assert len(ip.user_ns["kids"]) == 4 and len(ip.user_ns["grand"]) == 3
                assert ip.user_ns["grand"][0].eval("data[0]") == "np.float64(2.0)"  # kids[0]'s state
                assert len(res.result.tree) == 2 + 4 + 3  # py, the branch, kids, grand: this notebook's
        assert checked == ["run", "tree"], "the README's run and tree cells are the ones checked here"
        # the last cell cleaned up after the others: this notebook's sandboxes and snapshots are gone
        ctl = forkd.controller()
        assert ctl.list_sandboxes() == [] and ctl.list_snapshots() == []
    finally:
        for widget in widgets:
            widget.close()
