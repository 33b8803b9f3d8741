"""``kids = %forkd fork SB -n N`` (a fork tree) and ``%forkd keep kids[i]`` through a real IPython
shell against a real ``forkd serve``: the winner keeps its state, its siblings go, another
notebook's sandbox stays, and a wrong line is one UsageError saying what to do."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from forkd_server.client import ControllerError, Sandbox

from .conftest import cell, in_notebook
from .test_widget import comms, front_end_says, replies, wait_for  # noqa: F401 - comms: the recording comm fixture


def alive(ctl) -> set[str]:
    return {b["id"] for b in ctl.list_sandboxes()}


def test_fork_a_sandbox_then_keep_one(ip, forkd):
    ctl = forkd.controller()
    ip.run_line_magic("forkd", "snapshot -t kp --setup 'base = 1'")
    (source,) = ip.run_line_magic("forkd", "fork -t kp -n 1")
    source.run_code("before = 'fork'")
    ip.user_ns["source"] = source
    res, out = cell(ip, "kids = %forkd fork source -n 3")
    assert res.success, out.stderr
    kids = ip.user_ns["kids"]
    assert [type(k) for k in kids] == [Sandbox] * 3 and len({k.fork_tree_id for k in kids}) == 1
    res, out = cell(ip, '%%forkd run kids --each "mine=[0, 1, 2]"\nmine * 10')
    assert res.success, out.stderr
    res, out = cell(ip, "winner = %forkd keep kids[1]")
    assert res.success, out.stderr
    assert out.stdout.startswith(f"kept {kids[1].id} (fork tree {kids[1].fork_tree_id}): killed 2 siblings, "
                                 f"released snapshot ")
    winner = ip.user_ns["winner"]
    assert isinstance(winner, Sandbox) and winner.id == kids[1].id and winner.fork_tree_id is None
    assert alive(ctl) == {source.id, winner.id}
    assert winner.eval("(base, before, mine)") == "(1, 'fork', 1)"
    with pytest.raises(UsageError) as info:  # killed: the server says how it ended
        ip.run_line_magic("forkd", f"keep {kids[0].id}")
    assert str(info.value) == (f"forkd keep: sandbox {kids[0].id} not found: it lost fork tree {kids[0].fork_tree_id} "
                               f"to {winner.id}, which was promoted")


def test_keep_leaves_another_notebooks_sandbox(ip, forkd):
    ctl = forkd.controller()
    in_notebook(ip, "kernel-a", "a.ipynb")
    ip.run_line_magic("forkd", "snapshot -t kq")
    (source,) = ip.run_line_magic("forkd", "fork -t kq -n 1")
    kids = ip.run_line_magic("forkd", f"fork {source.id} -n 3")
    assert all(k.labels["jupyter.notebook"] == "a.ipynb" for k in kids)
    # notebook b checked kids[0] out: it carries b's labels now
    ctl.update_sandbox(kids[0].id, labels={"jupyter.kernel_id": "kernel-b", "jupyter.notebook": "b.ipynb"})
    ip.user_ns["kids"] = kids
    res, out = cell(ip, "%forkd keep kids[2]")
    assert res.success, out.stderr
    assert "killed 1 sibling\n" in out.stdout and f"kept sandbox {kids[0].id}: " in out.stdout
    assert "b.ipynb" in out.stdout  # whose it is now
    assert f"kept snapshot {kids[0].snapshot_tag}: {kids[0].id} was spawned from it" in out.stdout
    assert alive(ctl) == {source.id, kids[0].id, kids[2].id}


def test_wrong_lines_say_what_to_do(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t kr")
    (source,) = ip.run_line_magic("forkd", "fork -t kr -n 1")
    ip.user_ns["source"] = source
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("forkd", "keep source")
    assert str(info.value) == (f"forkd keep: sandbox {source.id} is in no open fork tree\nfork a sandbox into a tree "
                               f"first, then keep one of its children: kids = %forkd fork {source.id} -n 3")
    with pytest.raises(UsageError, match="not both"):
        ip.run_line_magic("forkd", "fork source -t kr -n 2")
    with pytest.raises(UsageError, match="forkd fork: -n must be at least 1"):
        ip.run_line_magic("forkd", "fork source -n 0")
    with pytest.raises(NameError, match="nokids"):
        ip.run_line_magic("forkd", "keep nokids[0]")
    with pytest.raises(ControllerError):  # nothing was forked by the refused lines
        source.controller.snapshot_info("ft-x")
    assert [s["tag"] for s in source.controller.list_snapshots()] == ["kr"]


def test_the_widgets_keep_button_promotes(forkd, comms):  # noqa: F811
    from forkd_magics import LineageWidget

    ctl = forkd.controller()
    ctl.create_snapshot("kw")
    source = ctl.spawn_sandboxes("kw", 1)[0]["id"]
    tree = ctl.fork_sandbox(source, 3)
    kids = [k["id"] for k in tree["sandboxes"]]
    w = LineageWidget(ctl)
    try:
        wait_for(lambda: all(w.tree.get(k, {}).get("labels", {}).get("fork_tree_id") for k in kids),
                 what="the tree's children, labelled, in the widget")
        front_end_says(w, {"action": "keep", "id": kids[0], "req": 1})
        assert replies(w)[1]["ok"] and w.message == (f"kept {kids[0]}: killed 2 siblings; released "
                                                     f"{tree['snapshot']['tag']}")
        assert {b["id"] for b in ctl.list_sandboxes()} == {source, kids[0]}
        wait_for(lambda: "fork_tree_id" not in w.tree.get(kids[0], {}).get("labels", {"fork_tree_id": 1}),
                 what="the winner's label gone from the widget's tree")
        front_end_says(w, {"action": "keep", "id": source, "req": 2})
        assert replies(w)[2]["ok"] is False and "in no open fork tree" in replies(w)[2]["message"]
    finally:
        w.close()
