"""``PATCH /v1/sandboxes/{id}``: a running sandbox gets more labels (or fewer) and a higher memory limit (the
forkd kernel's checkout makes a sandbox the notebook's this way). Through ``forkd serve``, as the
SDK and a raw client see it: the change is kept across a server restart and announced as an event;
a lower limit is a 409, bad bodies are 4xx."""

from __future__ import annotations

import pytest

from forkd_server.client import ControllerError

from .test_lossy_and_labels import raw


@pytest.fixture(scope="module")
def snap(ctl):
    ctl.create_snapshot("upd-base", setup="x = 1", labels={"team": "ml"})
    yield "upd-base"
    ctl.delete_snapshot("upd-base")


@pytest.fixture
def sandbox(ctl, snap):
    sb = ctl.spawn_sandboxes(snap, 1, memory_limit_mib=128)[0]["id"]
    yield sb
    try:
        ctl.kill_sandbox(sb)
    except ControllerError:
        pass


def test_labels_are_added_and_the_limit_raised_kept_and_announced(server, ctl, sandbox):
    events = ctl.events()
    try:
        info = ctl.update_sandbox(sandbox, labels={"jupyter.notebook": "nb.ipynb", "team": "ai"},
                                  memory_limit_mib=512)
        assert info["labels"] == {"team": "ai", "jupyter.notebook": "nb.ipynb"}  # a key given replaces its value
        assert info["memory_limit_mib"] == 512
        updated = next(e for e in events if e.get("action") == "updated")
        assert updated == {**updated, "kind": "sandbox", "id": sandbox, "memory_limit_mib": 512,
                           "labels": {"team": "ai", "jupyter.notebook": "nb.ipynb"}}
    finally:
        events.close()
    assert [s["id"] for s in ctl.list_sandboxes(labels={"jupyter.notebook": "nb.ipynb"})] == [sandbox]
    assert ctl.run_code(sandbox, "blob = b'x' * (300 << 20)")["exit_code"] == 0  # past the 128 it was made with
    server.crash_and_restart()
    again = ctl.get_sandbox(sandbox)
    assert (again["labels"]["jupyter.notebook"], again["memory_limit_mib"]) == ("nb.ipynb", 512)
    assert ctl.eval_code(sandbox, "len(blob) >> 20")["result"] == "300"  # re-attached, state intact


def test_labels_are_taken_off(server, ctl, sandbox):
    ctl.update_sandbox(sandbox, labels={"fork_tree_id": "ft-0123456789", "keep": "me"})
    info = ctl.update_sandbox(sandbox, remove_labels=["fork_tree_id", "never-there"])
    assert info["labels"] == {"team": "ml", "keep": "me"}  # a key it does not carry is no error
    assert ctl.get_sandbox(sandbox)["labels"] == {"team": "ml", "keep": "me"}


def test_an_empty_change_changes_nothing(server, ctl, sandbox):
    status, info = raw(server, "PATCH", f"/v1/sandboxes/{sandbox}", {"labels": {}, "memory_limit_mib": None})
    assert status == 200 and info["memory_limit_mib"] == 128 and info["labels"] == {"team": "ml"}


@pytest.mark.parametrize("body, status, message", [
    ({"memory_limit_mib": 64}, 409, "(128 MiB) can only be raised"),
    ({"memory_limit_mib": 8}, 400, "memory_limit_mib"),
    ({"memory_limit_mib": "lots"}, 422, "memory_limit_mib"),
    ({"memory_limit_mib": 1 << 40}, 400, "memory_limit_mib"),
    ({"labels": {"bad key": "v"}}, 400, "invalid label key"),
    ({"labels": ["a"]}, 422, "labels"),
    ({"remove_labels": "team"}, 422, "remove_labels"),
    ({"labels": {f"k{i}": "v" for i in range(32)}}, 400, "at most 32"),  # 33 with the one it has
])
def test_bad_changes_are_4xx_and_change_nothing(server, ctl, sandbox, body, status, message):
    got, reply = raw(server, "PATCH", f"/v1/sandboxes/{sandbox}", body)
    assert got == status and message in reply["error"], reply
    info = ctl.get_sandbox(sandbox)
    assert info["memory_limit_mib"] == 128 and info["labels"] == {"team": "ml"}


def test_host_means_all_of_the_hosts_memory_and_is_never_a_lowering(server, ctl, snap, sandbox):
    """``"host"``: the server resolves it to its own MemTotal (a caller behind a router cannot know
    which host it reaches); asked again of a sandbox that has it, it changes nothing (no 409)."""
    from forkd_server.controller.checks import host_memory_mib
    host = host_memory_mib()
    assert ctl.update_sandbox(sandbox, memory_limit_mib="host")["memory_limit_mib"] == host
    assert ctl.update_sandbox(sandbox, memory_limit_mib="host")["memory_limit_mib"] == host
    status, reply = raw(server, "PATCH", f"/v1/sandboxes/{sandbox}", {"memory_limit_mib": "all"})
    assert status == 422 and 'expected an integer (MiB) or "host"' in reply["error"], reply
    kid = ctl.spawn_sandboxes(snap, 1, memory_limit_mib="host")[0]
    try:
        assert kid["memory_limit_mib"] == host
    finally:
        ctl.kill_sandbox(kid["id"])


def test_a_sandbox_that_is_gone_is_404(server, ctl, snap):
    sb = ctl.spawn_sandboxes(snap, 1)[0]["id"]
    ctl.kill_sandbox(sb)
    status, reply = raw(server, "PATCH", f"/v1/sandboxes/{sb}", {"labels": {"a": "b"}})
    assert status == 404 and "it was killed" in reply["error"]
