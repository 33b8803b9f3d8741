"""Fork trees in the controller: a fork whose spawn fails leaves nothing behind (no branch, no
record), and a fork of a tree's child starts a tree of its own, whose label its branches never
carry."""

from __future__ import annotations

import pytest

from forkd_server.errors import BadRequest, Conflict, NotFound


@pytest.fixture
def source(ctl):
    ctl.create_snapshot("ftc", setup="x = 1")
    sb = ctl.spawn("ftc", 1)[0]["id"]
    yield sb
    for info in ctl.list_sandboxes():
        ctl.kill_sandbox(info["id"])
    for snap in sorted(ctl.list_snapshots(), key=lambda s: -len(s["lineage"])):
        ctl.delete_snapshot(snap["tag"])


def test_a_failed_spawn_leaves_no_branch_and_no_tree(ctl, source, monkeypatch):
    before = {s["tag"] for s in ctl.list_snapshots()}

    def refuse(*args, **kwargs):
        raise Conflict("spawn from the tree's branch: limit reached")  # as a full host answers

    monkeypatch.setattr(ctl, "spawn", refuse)
    with pytest.raises(Conflict):
        ctl.fork(source, 3)
    monkeypatch.undo()
    assert {s["tag"] for s in ctl.list_snapshots()} == before
    with ctl.registry.tx() as db:
        assert db.execute("SELECT COUNT(*) FROM fork_trees").fetchone()[0] == 0


def test_a_fork_of_a_child_is_a_tree_of_its_own(ctl, source):
    outer = ctl.fork(source, 2)
    child = outer["sandboxes"][0]["id"]
    inner = ctl.fork(child, 2)
    assert inner["fork_tree_id"] != outer["fork_tree_id"]
    assert "fork_tree_id" not in inner["snapshot"]["labels"]  # a branch never carries its source's tree
    assert all(k["labels"]["fork_tree_id"] == inner["fork_tree_id"] for k in inner["sandboxes"])
    mark = ctl.branch(child, "ftc-mark")
    assert "fork_tree_id" not in mark["labels"]
    kept = ctl.promote(inner["sandboxes"][1]["id"])
    assert kept["killed"] == [inner["sandboxes"][0]["id"]]
    assert ctl.get_sandbox(child)["labels"]["fork_tree_id"] == outer["fork_tree_id"]  # still in the outer tree
    with pytest.raises(BadRequest, match="is not in fork tree"):
        ctl.promote(child, inner["fork_tree_id"])
    with pytest.raises(NotFound):
        ctl.promote(child, "ft-0000000000")
