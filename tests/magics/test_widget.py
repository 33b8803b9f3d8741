"""The lineage widget's model through a test comm: tree, live updates from /v1/events, actions."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import comm
import pytest

from forkd_magics import LineageWidget
from forkd_magics._widget import build_tree


class RecordingComm:
    """Stands in for the kernel's comm: records what the widget sends to the front end."""

    comm_id = "test-comm"
    kernel = "test"

    def __init__(self, **kwargs):
        self.sent: list[dict] = []
        self.lock = threading.Lock()

    def open(self, *a, **k):
        pass

    def on_msg(self, *a, **k):
        pass

    def on_close(self, *a, **k):
        pass

    def send(self, data=None, metadata=None, buffers=None):
        with self.lock:
            self.sent.append(data)

    def close(self, *a, **k):
        pass

    def states(self) -> list[dict]:
        with self.lock:
            return [m["state"] for m in self.sent if m and m.get("method") == "update"]


@pytest.fixture
def comms(monkeypatch):
    made: list[RecordingComm] = []

    def create_comm(**kwargs):
        c = RecordingComm(**kwargs)
        made.append(c)
        return c

    monkeypatch.setattr(comm, "create_comm", create_comm)
    return made


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    """Bounded wait for a state the event thread produces."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def front_end_says(widget: LineageWidget, content: dict) -> None:
    """Deliver a custom message as the JavaScript's model.send() would."""
    widget._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})


def test_build_tree_edges_follow_lineage():
    snaps = [{"tag": "py", "lineage": ["py"], "status": "ready", "created_at_unix": 1},
             {"tag": "b", "lineage": ["py", "sb-1", "b"], "status": "writing", "pause_ms": 1.5,
              "branched_from": "sb-1", "created_at_unix": 2},
             {"tag": "orphan", "lineage": ["py", "sb-gone", "orphan"], "status": "ready", "created_at_unix": 3}]
    sbs = [{"id": "sb-1", "snapshot_tag": "py", "lineage": ["py", "sb-1"], "status": "running", "created_at_unix": 1},
           {"id": "sb-2", "snapshot_tag": "b", "lineage": ["py", "sb-1", "b", "sb-2"], "status": "running",
            "created_at_unix": 4}]
    tree = build_tree(snaps, sbs, {"b": ["writing"]})
    assert {k: v["parent"] for k, v in tree.items()} == {
        "py": None, "sb-1": "py", "b": "sb-1", "sb-2": "b", "orphan": "py"}  # killed source: nearest ancestor
    assert tree["b"]["pause_ms"] == 1.5 and tree["b"]["history"] == ["writing"]
    assert build_tree(snaps[:1], [], {"py": ["writing"]})["py"]["history"] == ["writing", "ready"]


def test_widget_syncs_tree_and_follows_events_live(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("wt")
    sb = ctl.spawn_sandboxes("wt", 1)[0]["id"]
    w = LineageWidget(ctl)
    try:
        assert w.live and set(w.tree) == {"wt", sb} and w.tree[sb]["parent"] == "wt"
        c = w.comm
        assert isinstance(c, RecordingComm) and c in comms
        # the front end's code is the package's own file, and it loads nothing from anywhere
        esm = (Path(__file__).parents[2] / "forkd_magics" / "lineage.js").read_text()
        assert str(w._esm) == esm and not re.search(r"^\s*import\b|import\(", esm, re.M)

        # a change made elsewhere (not through the widget) arrives over /v1/events
        info = ctl.branch_sandbox(sb, "wt-b", mode="live", wait=False)
        assert info["status"] in ("writing", "ready")
        wait_for(lambda: w.tree.get("wt-b", {}).get("status") == "ready", what="wt-b ready")
        node = w.tree["wt-b"]
        assert node["history"] == ["writing", "ready"] and node["parent"] == sb
        assert node["pause_ms"] == pytest.approx(info["pause_ms"])
        # and reached the front end through the comm, as state updates of the one tree trait
        synced = [s["tree"] for s in c.states() if "tree" in s]
        assert synced and synced[-1]["wt-b"]["history"] == ["writing", "ready"]
        assert set(synced[-1]) == {"wt", sb, "wt-b"}

        kids = ctl.spawn_sandboxes("wt-b", 2)
        wait_for(lambda: all(k["id"] in w.tree for k in kids), what="grandchildren")
        assert all(w.tree[k["id"]]["parent"] == "wt-b" for k in kids)
        ctl.kill_sandbox(kids[0]["id"])
        wait_for(lambda: kids[0]["id"] not in w.tree, what="killed sandbox to leave the tree")
    finally:
        w.close()
    assert not w.live


def test_buttons_run_actions_through_the_sdk(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("wa")
    w = LineageWidget(ctl)
    try:
        front_end_says(w, {"action": "fork", "id": "wa", "n": 3})
        assert w.message == "forked 3 sandboxes from wa"
        sandboxes = [b["id"] for b in ctl.list_sandboxes()]
        assert len(sandboxes) == 3
        wait_for(lambda: all(s in w.tree for s in sandboxes), what="forked sandboxes in the tree")

        front_end_says(w, {"action": "branch", "id": sandboxes[0]})
        assert w.message.startswith(f"branched {sandboxes[0]} into branch-{sandboxes[0]}-0 (paused ")
        wait_for(lambda: w.tree.get(f"branch-{sandboxes[0]}-0", {}).get("status") == "ready", what="branch")

        front_end_says(w, {"action": "kill", "id": sandboxes[1]})
        assert w.message == f"killed {sandboxes[1]}"
        assert sandboxes[1] not in {b["id"] for b in ctl.list_sandboxes()}

        front_end_says(w, {"action": "delete", "id": f"branch-{sandboxes[0]}-0"})
        assert w.message == f"deleted branch-{sandboxes[0]}-0"
        wait_for(lambda: f"branch-{sandboxes[0]}-0" not in w.tree, what="deleted snapshot to leave")

        # errors come back as one line in the widget, nothing raises in the kernel
        front_end_says(w, {"action": "kill", "id": "sb-nope"})
        assert w.message == "error: kill sb-nope: sandbox sb-nope not found"
        front_end_says(w, {"action": "explode", "id": "wa"})
        assert w.message == "error: unknown action 'explode'"
    finally:
        w.close()


def test_static_widget_does_not_follow(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("ws")
    w = LineageWidget(ctl, live=False)
    try:
        assert not w.live and set(w.tree) == {"ws"}
        ctl.spawn_sandboxes("ws", 1)
        assert set(w.tree) == {"ws"}
        assert len(w.refresh()) == 2 and len(w.tree) == 2
    finally:
        w.close()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_javascript_layout_and_ages():
    """The ESM's pure parts (layout, ages) under node: parents centred on children, one row per leaf."""
    src = Path(__file__).parents[2] / "forkd_magics" / "lineage.js"
    with tempfile.TemporaryDirectory() as d:
        mod = Path(d) / "lineage.mjs"
        mod.write_text(src.read_text())
        script = f"""
        import {{ layout, age }} from {json.dumps(str(mod))};
        const tree = {{ py: {{parent: null}}, a: {{parent: "py"}}, b: {{parent: "py"}}, br: {{parent: "a"}},
                        g1: {{parent: "br"}}, g2: {{parent: "br"}} }};
        console.log(JSON.stringify({{ l: layout(tree), ages: [age(100, 105), age(0, 125), age(0, 7300), age(null, 1)] }}));
        """
        out = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    pos, ages = got["l"]["pos"], got["ages"]
    assert got["l"]["rows"] == 3 and got["l"]["cols"] == 4
    assert [pos[k]["depth"] for k in ("py", "a", "br", "g1", "b")] == [0, 1, 2, 3, 1]
    assert pos["br"]["y"] == (pos["g1"]["y"] + pos["g2"]["y"]) / 2
    assert pos["py"]["y"] == (pos["a"]["y"] + pos["b"]["y"]) / 2
    assert ages == ["5s", "2m 5s", "2h 1m", ""]


def test_widget_resubscribes_when_the_stream_drops(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("wr")
    w = LineageWidget(ctl)
    try:
        dropped = w._stream
        dropped.close()  # as if the server had closed the connection
        wait_for(lambda: w._stream is not dropped, what="a new subscription")
        sb = ctl.spawn_sandboxes("wr", 1)[0]["id"]
        wait_for(lambda: sb in w.tree, what="the sandbox made after the drop")
        assert w.live
    finally:
        w.close()
