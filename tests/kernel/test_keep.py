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


def test_keep_of_a_sandbox_that_is_gone_says_keep(kernel, forkd_server):
    """The notebook moves into the winner first (a checkout), but the error is said as what the user
    ran: ``forkd keep: ...``, not ``forkd checkout: ...``."""
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    assert run(kc, "kids = %forkd fork -n 2").ok
    gone = [s["id"] for s in ctl.list_sandboxes() if s["labels"].get("fork_tree_id")][0]
    ctl.kill_sandbox(gone)
    kept = run(kc, f"%forkd keep {gone}")
    assert kept.content["ename"] == "UsageError"
    assert kept.content["evalue"].startswith(f"forkd keep: sandbox {gone} not found: it was killed"), kept.content
    assert run(kc, "%forkd kill kids").content["ename"] == "UsageError"  # one of them gone: said, the other killed
