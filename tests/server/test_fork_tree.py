"""Fork trees through a real ``forkd serve``: ``POST /v1/sandboxes/{id}/fork`` and ``.../promote``,
through the sync and the async SDK. The winner keeps its state (what was there before the fork and
its own change), its siblings go, the tree's snapshot is released only when nothing needs it, and
nothing another notebook, a workspace or a tag holds is touched. Bad input answers 4xx saying what
to do."""

from __future__ import annotations

import pytest

from forkd_server.client import AsyncController, AsyncSandbox, ControllerError, Sandbox, Snapshot


@pytest.fixture(scope="module")
def snap(ctl):
    return Snapshot.create("ftree", controller=ctl, setup="base = 41")


@pytest.fixture
def parent(snap, ctl):
    """A running sandbox with state of its own, set after its snapshot (``before = 'fork'``)."""
    sb = snap.fork()[0]
    sb.run_code("before = 'fork'")
    yield sb
    for info in ctl.list_sandboxes():  # whatever the test left, children included
        ctl.kill_sandbox(info["id"])


def gone(ctl, sandbox_id: str) -> str:
    """The 404 message of a sandbox that must be gone."""
    with pytest.raises(ControllerError) as info:
        ctl.get_sandbox(sandbox_id)
    assert info.value.status == 404
    return info.value.message


def tags(ctl) -> set[str]:
    return {s["tag"] for s in ctl.list_snapshots()}


def test_fork_tree_then_promote_keeps_the_winner_and_drops_the_rest(ctl, parent):
    tree = ctl.fork_sandbox(parent.id, 3)
    tree_id, kids = tree["fork_tree_id"], tree["sandboxes"]
    assert len(kids) == 3 and tree["snapshot"]["status"] == "ready" and tree["snapshot"]["tag"] in tags(ctl)
    assert all(k["labels"]["fork_tree_id"] == tree_id and k["snapshot_tag"] == tree["snapshot"]["tag"] for k in kids)
    assert "fork_tree_id" not in tree["snapshot"]["labels"]  # the label names the members only
    for i, kid in enumerate(kids):
        assert not ctl.run_code(kid["id"], f"mine = {i}").get("error")
    winner = kids[1]["id"]
    result = ctl.promote_sandbox(winner, tree_id)
    assert sorted(result["killed"]) == sorted(k["id"] for k in kids if k["id"] != winner)
    assert result["released"] == [tree["snapshot"]["tag"]] and result["kept"] == [] and result["failed"] == []
    assert result["winner"]["id"] == winner and "fork_tree_id" not in result["winner"]["labels"]
    for sibling in result["killed"]:
        assert f"lost fork tree {tree_id} to {winner}" in gone(ctl, sibling)
    assert tree["snapshot"]["tag"] not in tags(ctl)
    # the winner's state: what the parent had before the fork, and its own change
    assert ctl.eval_code(winner, "(base, before, mine)")["result"] == "(41, 'fork', 1)"
    assert ctl.eval_code(parent.id, "before")["result"] == "'fork'"  # the source runs on, untouched
    # promoting the winner again is harmless: nothing left to drop
    again = ctl.promote_sandbox(winner, tree_id)
    assert again["killed"] == [] and again["released"] == []


def test_what_others_hold_survives_a_promote(ctl, parent, server):
    tree = ctl.fork_sandbox(parent.id, 4, labels={"jupyter.kernel_id": "mine"})
    tree_id, snapshot = tree["fork_tree_id"], tree["snapshot"]["tag"]
    winner, taken, head, plain = (k["id"] for k in tree["sandboxes"])
    # another notebook checked a sibling out (its labels are now that notebook's) ...
    ctl.update_sandbox(taken, labels={"jupyter.kernel_id": "theirs", "jupyter.notebook": "theirs.ipynb"})
    # ... another forkd kernel runs in one ...
    ctl.set_kernel_head("kernel-b", head, notebook="b.ipynb")
    # ... someone branched the last one into a tag of theirs and spawned a sandbox of the tree's snapshot
    ctl.run_code(plain, "theirs = 'kept'")
    ctl.branch_sandbox(plain, "their-tag")
    user = ctl.spawn_sandboxes(snapshot, 1)[0]["id"]
    try:
        result = ctl.promote_sandbox(winner)  # the tree from the winner's label
        assert result["fork_tree_id"] == tree_id and result["killed"] == [plain]
        kept = {k["id"]: k["reason"] for k in result["kept"]}
        assert "theirs.ipynb" in kept[taken] and "b.ipynb" in kept[head] and user in kept[snapshot]
        assert result["released"] == []
        for sb in (winner, taken, head, user):
            assert ctl.ping_sandbox(sb)
        assert "fork_tree_id" not in ctl.get_sandbox(taken)["labels"]  # the tree is closed for them too
        assert {"their-tag", snapshot} <= tags(ctl)
        child = ctl.spawn_sandboxes("their-tag", 1)[0]["id"]
        assert ctl.eval_code(child, "theirs")["result"] == "'kept'"
    finally:
        ctl.forget_kernel("kernel-b")
        for tag in ("their-tag", snapshot):
            ctl.delete_snapshot(tag)


def test_a_tree_snapshot_with_a_tag_of_yours_stays(ctl, parent):
    tree = ctl.fork_sandbox(parent.id, 2, tag="my-tree")
    assert tree["snapshot"]["tag"] == "my-tree"
    result = ctl.promote_sandbox(tree["sandboxes"][0]["id"])
    assert result["released"] == [] and result["kept"][0]["id"] == "my-tree"
    assert "tag" in result["kept"][0]["reason"] and "my-tree" in tags(ctl)
    ctl.delete_snapshot("my-tree")


def test_cleanup_siblings_false_keeps_them_and_closes_the_tree(ctl, parent):
    tree = ctl.fork_sandbox(parent.id, 2)
    first, second = (k["id"] for k in tree["sandboxes"])
    result = ctl.promote_sandbox(first, cleanup_siblings=False)
    assert result["killed"] == [] and {k["id"] for k in result["kept"]} == {second, tree["snapshot"]["tag"]}
    with pytest.raises(ControllerError) as info:  # the tree is decided: the sibling cannot win it now
        ctl.promote_sandbox(second, tree["fork_tree_id"])
    assert info.value.status == 409 and first in info.value.message
    ctl.delete_snapshot(tree["snapshot"]["tag"])


def test_bad_input_is_a_4xx_saying_what_to_do(ctl, parent):
    def refused(call, status: int, words: str) -> None:
        with pytest.raises(ControllerError) as info:
            call()
        assert info.value.status == status, info.value.message
        assert words in info.value.message, info.value.message

    before = tags(ctl)
    refused(lambda: ctl.fork_sandbox(parent.id, 0), 400, "count` must be at least 1 and at most 1000")
    refused(lambda: ctl.fork_sandbox(parent.id, 1001), 400, "at most 1000")
    refused(lambda: ctl._request("POST", f"/v1/sandboxes/{parent.id}/fork", {"count": "3"}), 422, "count")
    refused(lambda: ctl._request("POST", f"/v1/sandboxes/{parent.id}/fork", {}), 422, "missing field `count`")
    refused(lambda: ctl.fork_sandbox(parent.id, 2, labels={"fork_tree_id": "x"}), 400, "leave it out")
    refused(lambda: ctl.fork_sandbox(parent.id, 2, tag="no spaces"), 400, "invalid tag")
    refused(lambda: ctl.fork_sandbox("sb-00000000-0000", 2), 404, "not found")
    assert tags(ctl) == before  # nothing was branched by a refused fork
    refused(lambda: ctl.promote_sandbox(parent.id), 400, "in no open fork tree")
    refused(lambda: ctl.promote_sandbox(parent.id, "ft-nosuchtree"), 404, "fork tree ft-nosuchtree not found")
    tree = ctl.fork_sandbox(parent.id, 1)
    refused(lambda: ctl.promote_sandbox(parent.id, tree["fork_tree_id"]), 400, "its members: " + tree["sandboxes"][0]["id"])
    refused(lambda: ctl._request("POST", f"/v1/sandboxes/{parent.id}/promote", {"tree_id": 7}), 422, "tree_id")
    refused(lambda: ctl.promote_sandbox("sb-00000000-0000", tree["fork_tree_id"]), 404, "not found")
    ctl.promote_sandbox(tree["sandboxes"][0]["id"])


def test_sdk_objects(ctl, parent):
    kids = parent.fork(3)
    assert [type(k) for k in kids] == [Sandbox] * 3 and len({k.fork_tree_id for k in kids}) == 1
    assert kids[0].fork_tree_id.startswith("ft-") and "fork_tree_id=" in repr(kids[0])
    kids[2].run_code("mine = 'winner'")
    result = kids[2].promote()
    assert kids[2].fork_tree_id is None and sorted(result["killed"]) == sorted(k.id for k in kids[:2])
    assert kids[2].eval("(before, mine)") == "('fork', 'winner')"


async def test_async_sdk(server, parent):
    async with AsyncController(server.url, server.token) as actl:
        sb = await AsyncSandbox.connect(parent.id, actl)
        kids = await sb.fork(2)
        assert [type(k) for k in kids] == [AsyncSandbox] * 2 and kids[0].fork_tree_id == kids[1].fork_tree_id
        await kids[0].run_code("mine = 0")
        result = await kids[0].promote()
        assert result["killed"] == [kids[1].id] and len(result["released"]) == 1
        assert await kids[0].eval("(before, mine)") == "('fork', 0)"
        with pytest.raises(ControllerError) as info:
            await kids[1].ping()
        assert info.value.status == 404


def test_cli(server, ctl, parent):
    import json

    from .test_serve import cli, one_line

    tree = json.loads(cli(server, "fork", parent.id, "-n", "2", "--json").stdout)
    first, second = (k["id"] for k in tree["sandboxes"])
    shown = " ".join(cli(server, "fork", parent.id, "-n", "1").stdout.split())
    assert "fork tree ft-" in shown and "forkd promote sb-" in shown
    out = " ".join(cli(server, "promote", second).stdout.split())  # rich wraps at the terminal's width
    assert out.startswith(f"{second} won fork tree {tree['fork_tree_id']}: killed 1 sibling(s), released snapshot "
                          f"{tree['snapshot']['tag']}")
    assert first not in {b["id"] for b in ctl.list_sandboxes()}
    assert len(json.loads(cli(server, "fork", "--tag", "ftree", "-n", "1", "--json").stdout)) == 1  # forkd's spawn
    said = one_line(cli(server, "fork", parent.id, "-n", "0", check=False))
    assert said == "forkd fork: -n must be at least 1 and at most 1000, got 0\n"  # the wire's `count`, as typed
    said = one_line(cli(server, "fork", parent.id, "-n", "100000", check=False))
    assert said == "forkd fork: -n must be at least 1 and at most 1000, got 100000\n"
    said = one_line(cli(server, "promote", parent.id, check=False))
    assert said == (f"forkd promote: sandbox {parent.id} is in no open fork tree (HTTP 400); fork a sandbox into a "
                    f"tree first, then keep one of its children: forkd fork {parent.id} -n 3\n")
    said = one_line(cli(server, "fork", check=False))
    assert "give a SANDBOX to fork (a fork tree), or --tag SNAPSHOT" in said


def test_a_restarted_server_still_promotes(server, ctl, parent):
    tree = ctl.fork_sandbox(parent.id, 2)
    first, second = (k["id"] for k in tree["sandboxes"])
    server.crash_and_restart()  # kill -9: the tree's record and its sandboxes outlive it
    result = ctl.promote_sandbox(second)
    assert result["fork_tree_id"] == tree["fork_tree_id"] and result["killed"] == [first]
    assert result["released"] == [tree["snapshot"]["tag"]]
