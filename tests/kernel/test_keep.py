"""``%forkd keep`` in the forkd kernel: the notebook moves into the winner (as ``%forkd checkout``),
then its siblings go; the notebook goes on with the winner's state."""

from __future__ import annotations

from forkd_server.client import Controller

from .cells import head_of, run


def test_keep_checks_the_winner_out_then_drops_its_siblings(kernel, forkd_server):
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    assert run(kc, "x = 21").ok
    before = head_of(kc)
    forked = run(kc, "kids = %forkd fork -n 3")
    assert forked.ok, forked.text
    ids = [s["id"] for s in ctl.list_sandboxes() if s["labels"].get("fork_tree_id")]
    assert len(ids) == 3
    each = run(kc, '%%forkd run kids --each "mine=[0, 1, 2]"\nmine')
    assert each.ok, each.text
    kept = run(kc, "%forkd keep kids[2]")
    assert kept.ok, kept.text
    assert f"HEAD: {before} → {ids[2]}" in kept.text and "killed 2 siblings" in kept.text
    assert head_of(kc) == ids[2]
    assert run(kc, "(x, mine)").result == "(21, 2)"  # the state before the fork, and the winner's own
    running = {s["id"] for s in ctl.list_sandboxes()}
    assert ids[2] in running and not running & {ids[0], ids[1]} and before in running
    assert run(kc, "%forkd checkout -").ok  # back where the notebook was before the fork
    assert run(kc, "x").result == "21" and run(kc, "'mine' in dir()").result == "False"
