"""forkd's own PyPI SDK (``forkd`` 0.5.3, pure stdlib; the test extra installs it: its import name
``forkd`` is no module of ours, and it has no console script to clash with our ``forkd`` CLI) makes
its wire calls unchanged against ``forkd router`` in front of two hosts, and against one
``forkd serve``: list, spawn n > 1, get, eval, exec, ping, branch, a spawn of the branch, kill, an
unknown id (forkd's ``ControllerError`` with the 404) and delete."""

from __future__ import annotations

import forkd  # forkd's PyPI SDK (scripts/setup.sh test installs it, from pyproject's test extra)
import pytest

from forkd_server.client import Controller as Ours

from ..serving import serving
from .fleet import fleet


def _wire_calls(sdk: forkd.Controller, tag: str, expect_host: str | None = None) -> None:
    """forkd's calls on a snapshot ``tag``; ``expect_host``: the host that holds it (router only)."""
    assert tag in [s["tag"] for s in sdk.list_snapshots()]
    kids = sdk.spawn_sandboxes(tag, n=3)
    assert len(kids) == 3 and all(k["snapshot_tag"] == tag for k in kids)
    if expect_host is not None:
        assert {k["host"] for k in kids} == {expect_host}
    sid = kids[0]["id"]
    got = sdk.get_sandbox(sid)
    assert got["id"] == sid and got["snapshot_tag"] == tag
    assert sdk.eval_code(sid, "x + 1")["result"] == "42"
    ran = sdk.exec_command(sid, ["python3", "-c", "print(2 + 2)"])
    assert (ran["stdout"], ran["exit_code"]) == ("4\n", 0)
    assert isinstance(sdk.ping_sandbox(sid), dict)
    branch = sdk.branch_sandbox(sid, tag=f"{tag}-b")
    assert branch["tag"] == f"{tag}-b"
    grandkid = sdk.spawn_sandboxes(f"{tag}-b")[0]
    if expect_host is not None:
        assert branch["host"] == grandkid["host"] == expect_host  # the branch's host holds it
    assert sdk.eval_code(grandkid["id"], "x + 1")["result"] == "42"  # the branch carries the setup
    assert {k["id"] for k in kids} | {grandkid["id"]} <= {s["id"] for s in sdk.list_sandboxes()}
    for kid in (*kids, grandkid):
        assert sdk.kill_sandbox(kid["id"]) is None
    with pytest.raises(forkd.ControllerError) as refused:
        sdk.get_sandbox(sid)
    assert refused.value.status == 404 and "error" in refused.value.body
    with pytest.raises(forkd.ControllerError) as refused:
        sdk.get_sandbox("sb-no-such-sandbox")
    assert refused.value.status == 404 and "error" in refused.value.body
    assert sdk.delete_snapshot(f"{tag}-b") is None
    assert f"{tag}-b" not in [s["tag"] for s in sdk.list_snapshots()]


def test_forkds_sdk_through_the_router_to_two_hosts():
    with fleet(2) as (router, hosts):
        # one snapshot on each host: the SDK's list merges both, and each call reaches its host
        made = Ours(router.url, router.token).create_snapshot("pya", setup="x = 41")
        other = next(h for h in hosts if h.url != made["host"])
        Ours(other.url, other.token).create_snapshot("pyb", setup="x = 41")
        sdk = forkd.Controller(router.url, router.token)
        listed = {s["tag"]: s["host"] for s in sdk.list_snapshots()}
        assert listed == {"pya": made["host"], "pyb": other.url}
        _wire_calls(sdk, "pya", made["host"])
        _wire_calls(sdk, "pyb", other.url)
        for tag in ("pya", "pyb"):
            assert sdk.delete_snapshot(tag) is None
        assert sdk.list_snapshots() == []


def test_forkds_sdk_against_one_host():
    with serving() as srv:
        Ours(srv.url, srv.token).create_snapshot("py", setup="x = 41")
        sdk = forkd.Controller(srv.url, srv.token)
        _wire_calls(sdk, "py")
        assert sdk.delete_snapshot("py") is None
