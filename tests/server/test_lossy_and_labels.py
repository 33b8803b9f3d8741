"""Lossy branches and labels through ``forkd serve``, as the SDK and CLI see them.

A branch that would lose running work is a 409 that names it; asked for with ``lossy`` it goes ahead
and the snapshot keeps the list (reply, GET, tree, a server restart, the SDK's ForkWarning, the
CLI's warning). Labels are set on create, spawn and branch, flow down the lineage, filter the
listings and the tree, and survive a restart.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from forkd_server.client import ForkWarning, Snapshot

from ..rest import exchange
from ..serving import FORKD

THREAD = ("import threading, time\n"
          "ticker = threading.Thread(target=lambda: time.sleep(3600), name='ticker', daemon=True)\n"
          "ticker.start()")


@pytest.fixture(scope="module")
def snap(server, ctl):
    status, info = raw(server, "POST", "/v1/snapshots", {"tag": "lossy-base", "setup": "x = 1",
                                                         "labels": {"team": "ml"}})
    assert status == 201, info
    return Snapshot(info, ctl)


def raw(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    return exchange(server.url + path, method, body, {"Authorization": f"Bearer {server.token}"})


def test_a_branch_that_would_lose_a_thread_is_refused_then_warned_and_kept(server, ctl, snap):
    sb = snap.fork()[0]
    try:
        sb.run_code(THREAD)
        lost = sb.inventory()
        assert any("ticker" in item for item in lost), lost

        status, body = raw(server, "POST", f"/v1/sandboxes/{sb.id}/branch", {"tag": "lossy-refused"})
        assert status == 409
        assert "ticker" in body["error"] and "lossy" in body["error"] and "VM engine" in body["error"]
        assert all(s["tag"] != "lossy-refused" for s in ctl.list_snapshots())  # nothing half-written

        with pytest.warns(ForkWarning, match="ticker"):
            branch = sb.branch("lossy-kept", lossy=True)
        assert any("ticker" in w for w in branch.warnings)
        # kept with the snapshot: its info, the tree, and after a server crash and restart
        assert any("ticker" in w for w in ctl.snapshot_info("lossy-kept").get("warnings", []))
        node = next(n for n in ctl.tree() if n["id"] == "lossy-kept")
        assert any("ticker" in w for w in node["warnings"])
        server.crash_and_restart()
        assert any("ticker" in w for w in ctl.snapshot_info("lossy-kept")["warnings"])
        # the branch itself works: its children have the state, without the thread
        child = Snapshot("lossy-kept", ctl).fork()[0]
        assert child.eval("x") == "1"
        assert child.eval("ticker.is_alive()") == "False"
        assert child.inventory() == []
        child.kill()
    finally:
        sb.kill()


def test_the_cli_says_what_a_lossy_branch_left_behind(server, ctl, snap):
    sb = snap.fork()[0]
    try:
        sb.run_code(THREAD)
        env = {**os.environ, "FORKD_URL": server.url, "FORKD_TOKEN": server.token}
        refused = subprocess.run([*FORKD, "snapshot", "--from-sandbox", sb.id, "--tag", "cli-refused"],
                                 capture_output=True, text=True, env=env, timeout=120)
        assert refused.returncode != 0 and "ticker" in refused.stderr and "--lossy" in refused.stderr
        done = subprocess.run([*FORKD, "snapshot", "--from-sandbox", sb.id, "--tag", "cli-lossy", "--lossy"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "did not carry" in done.stderr and "ticker" in done.stderr
    finally:
        sb.kill()


def test_a_lossy_setup_warns_through_the_sdk_and_the_cli(server, ctl):
    with pytest.warns(ForkWarning, match="ticker") as caught:
        info = ctl.create_snapshot("lossy-setup", setup=THREAD, lossy=True)
    assert "lossy-setup: its children lack what its setup left running" in str(caught[0].message)
    assert any("ticker" in w for w in info["warnings"])
    env = {**os.environ, "FORKD_URL": server.url, "FORKD_TOKEN": server.token}
    done = subprocess.run([*FORKD, "snapshot", "--tag", "lossy-setup-cli", "--setup", THREAD, "--lossy"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "lossy-setup-cli did not carry (--lossy)" in done.stderr and "ticker" in done.stderr
    assert "ForkWarning" not in done.stderr  # said once, in the CLI's words
    for tag in ("lossy-setup", "lossy-setup-cli"):
        ctl.delete_snapshot(tag)


def test_a_clean_setup_warns_nothing(ctl):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForkWarning)
        assert "warnings" not in ctl.create_snapshot("clean-setup", setup="x = 1", lossy=True)
    ctl.delete_snapshot("clean-setup")


def test_a_sandbox_with_nothing_running_branches_without_a_word(ctl, snap):
    sb = snap.fork()[0]
    try:
        assert sb.inventory() == []
        branch = sb.branch("lossy-clean")
        assert branch.warnings == []
    finally:
        sb.kill()


def test_labels_flow_down_the_lineage_and_filter(server, ctl, snap):
    assert ctl.snapshot_info("lossy-base")["labels"] == {"team": "ml"}
    status, mine = raw(server, "POST", "/v1/sandboxes", {"snapshot_tag": "lossy-base", "n": 2,
                                                         "labels": {"jupyter.kernel_id": "k-1"}})
    assert status == 201
    status, other = raw(server, "POST", "/v1/sandboxes", {"snapshot_tag": "lossy-base",
                                                          "labels": {"jupyter.kernel_id": "k-2"}})
    assert status == 201
    try:
        assert mine[0]["labels"] == {"team": "ml", "jupyter.kernel_id": "k-1"}  # the snapshot's, then its own

        status, listed = raw(server, "GET", "/v1/sandboxes?label=jupyter.kernel_id=k-1")
        assert status == 200 and sorted(s["id"] for s in listed) == sorted(s["id"] for s in mine)
        status, listed = raw(server, "GET", "/v1/sandboxes?label=team=ml&label=jupyter.kernel_id=k-2")
        assert [s["id"] for s in listed] == [other[0]["id"]]

        status, branch = raw(server, "POST", f"/v1/sandboxes/{mine[0]['id']}/branch",
                             {"tag": "labelled-branch", "labels": {"step": "2"}})
        assert status == 201
        assert branch["labels"] == {"team": "ml", "jupyter.kernel_id": "k-1", "step": "2"}
        status, snaps = raw(server, "GET", "/v1/snapshots?label=step=2")
        assert [s["tag"] for s in snaps] == ["labelled-branch"]

        # the tree keeps a matching node's ancestors, so its lineage stays whole
        status, nodes = raw(server, "GET", "/v1/tree?label=jupyter.kernel_id=k-2")
        assert {n["id"] for n in nodes} == {"lossy-base", other[0]["id"]}

        server.crash_and_restart()
        assert ctl.get_sandbox(mine[1]["id"])["labels"]["jupyter.kernel_id"] == "k-1"
        assert ctl.snapshot_info("labelled-branch")["labels"]["step"] == "2"
        # clients that send no labels see no change: everything is listed
        assert {s["id"] for s in ctl.list_sandboxes()} >= {mine[0]["id"], mine[1]["id"], other[0]["id"]}
    finally:
        for sb in mine + other:
            ctl.kill_sandbox(sb["id"])


@pytest.mark.parametrize("body, message", [
    ({"labels": ["a"]}, "labels"),
    ({"labels": {"a": 1}}, "labels"),
    ({"labels": {"bad key": "v"}}, "invalid label key"),
    ({"labels": {"k": "v" * 300}}, "at most 256"),
    ({"labels": {f"k{i}": "v" for i in range(40)}}, "at most 32"),
])
def test_bad_labels_are_4xx(server, snap, body, message):
    status, reply = raw(server, "POST", "/v1/sandboxes", {"snapshot_tag": "lossy-base", **body})
    assert 400 <= status < 500 and message in reply["error"]


def test_a_bad_label_filter_is_400(server, snap):
    status, reply = raw(server, "GET", "/v1/sandboxes?label=novalue")
    assert status == 400 and "key=value" in reply["error"]
