"""The lineage widget's model through a test comm: tree, live updates from /v1/events, actions."""

from __future__ import annotations

import base64
import html
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
from forkd_magics._scope import Scope
from forkd_magics._static import static_svg, with_ghosts
from forkd_magics._widget import ESM_FILES, build_tree, widget_esm


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


def replies(widget: LineageWidget) -> dict:
    """The kernel's answers to the page's requests, by request number."""
    with widget.comm.lock:
        sent = list(widget.comm.sent)
    return {m["content"]["reply"]: m["content"] for m in sent
            if m and m.get("method") == "custom" and "reply" in m.get("content", {})}


def test_build_tree_keeps_direct_parents_and_the_static_picture_draws_ghosts():
    snaps = [{"tag": "py", "lineage": ["py"], "status": "ready", "created_at_unix": 1, "engine": "process"},
             {"tag": "b", "lineage": ["py", "sb-1", "b"], "status": "writing", "pause_ms": 1.5,
              "branched_from": "sb-1", "created_at_unix": 2},
             {"tag": "orphan", "lineage": ["py", "sb-gone", "orphan"], "status": "ready", "created_at_unix": 3,
              "warnings": ["a thread was running: not carried"]}]
    sbs = [{"id": "sb-1", "snapshot_tag": "py", "lineage": ["py", "sb-1"], "status": "running", "created_at_unix": 1},
           {"id": "sb-2", "snapshot_tag": "b", "lineage": ["py", "sb-1", "b", "sb-2"], "status": "running",
            "created_at_unix": 4}]
    tree = build_tree(snaps, sbs, {"b": ["writing"]})
    # the server's direct parents, even a killed one: the drawing puts a ghost there
    assert {k: v["parent"] for k, v in tree.items()} == {
        "py": None, "sb-1": "py", "b": "sb-1", "sb-2": "b", "orphan": "sb-gone"}
    assert tree["orphan"]["lineage"] == ["py", "sb-gone", "orphan"]
    assert tree["orphan"]["warnings"] == ["a thread was running: not carried"]
    assert tree["py"]["engine"] == "process" and tree["b"]["pause_ms"] == 1.5
    assert tree["b"]["history"] == ["writing"]
    assert build_tree(snaps[:1], [], {"py": ["writing"]})["py"]["history"] == ["writing", "ready"]

    full = with_ghosts(tree)
    assert full["sb-gone"] == {"kind": "sandbox", "parent": "py", "status": "killed", "ghost": True}
    svg = static_svg(tree)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert "sb-gone · killed (gone)" in svg and "⚠ 1 warning(s)" in svg and "writing" in svg
    # four alike leaves under one parent fold into one row, as in the live drawing
    many = dict(tree, **{f"sb-k{i}": {"kind": "sandbox", "parent": "py", "status": "running", "lineage": ["py", f"sb-k{i}"]}
                         for i in range(4)})
    assert "4 × running (sandboxes)" in static_svg(many) and "sb-k0" not in static_svg(many)
    assert "&lt;x&gt;" in static_svg({"<x>": {"kind": "snapshot", "parent": None, "status": "ready"}})
    # a tombstone (what left the server since the tree was drawn) is counted apart and drawn as gone
    gone = static_svg(dict(tree, **{"sb-t": {"kind": "sandbox", "parent": "py", "status": "killed", "tomb": True,
                                             "history": ["running", "killed"], "lineage": ["py", "sb-t"]}}))
    assert "2 sandbox(es), 1 gone when the cell ran" in gone and "● sb-t · running → killed<" in gone


def test_widget_syncs_tree_and_follows_events_live(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("wt")
    sb = ctl.spawn_sandboxes("wt", 1)[0]["id"]
    w = LineageWidget(ctl)
    try:
        assert w.live and set(w.tree) == {"wt", sb} and w.tree[sb]["parent"] == "wt"
        c = w.comm
        assert isinstance(c, RecordingComm) and c in comms
        # the front end's code is the package's own files (the drawing the lab panel bundles too),
        # as one module that loads nothing from anywhere
        esm = str(w._esm)
        assert esm == widget_esm() and not re.search(r"^\s*import\b|import\(|\bfrom\s+[\"']", esm, re.M)
        assert ESM_FILES == ("lineage_tree.js", "lineage.js", "lineage_widget.js")
        assert esm.index("export function withGhosts") < esm.index("export class LineageView") < esm.index("function render(")
        assert esm.rstrip().endswith("export default { render };")

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
        # it stays as a tombstone in the kernel's tree (not only in a page that saw it go), so a
        # view drawn later, as under Run All, shows the same tree
        wait_for(lambda: w.tree.get(kids[0]["id"], {}).get("tomb"), what="killed sandbox to be a tombstone")
        assert w.tree[kids[0]["id"]]["status"] == "killed"
        assert w.tree[kids[0]["id"]]["history"] == ["running", "killed"]
        wait_for(lambda: c.states()[-1].get("tree", {}).get(kids[0]["id"], {}).get("tomb"), what="the page told")
        assert "1 gone" in repr(w) and "2 sandboxes" in repr(w)
    finally:
        w.close()
    assert not w.live


def test_a_sandbox_labelled_later_enters_a_notebooks_tree(forkd, comms):
    """A checkout labels another's sandbox as this notebook's (PATCH, an 'updated' event): the
    widget scoped to the notebook takes it in without being told otherwise."""
    from forkd_magics._scope import KERNEL_ID, Scope

    ctl = forkd.controller()
    ctl.create_snapshot("wl")
    sb = ctl.spawn_sandboxes("wl", 1)[0]["id"]
    w = LineageWidget(ctl, scope=Scope("k-mine", None))
    try:
        assert sb not in w.tree
        ctl.update_sandbox(sb, labels={KERNEL_ID: "k-mine"})
        wait_for(lambda: sb in w.tree, what="the relabelled sandbox to enter the tree")
        assert w.tree[sb]["labels"][KERNEL_ID] == "k-mine" and "wl" in w.tree  # with its ancestor
    finally:
        w.close()


def test_buttons_run_actions_through_the_sdk(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("wa")
    w = LineageWidget(ctl)
    try:
        front_end_says(w, {"action": "fork", "id": "wa", "n": 3, "req": 1})
        assert w.message == "forked 3 sandboxes from wa"
        assert replies(w)[1] == {"reply": 1, "ok": True, "message": "forked 3 sandboxes from wa"}
        sandboxes = [b["id"] for b in ctl.list_sandboxes()]
        assert len(sandboxes) == 3
        wait_for(lambda: all(s in w.tree for s in sandboxes), what="forked sandboxes in the tree")

        front_end_says(w, {"action": "branch", "id": sandboxes[0], "mode": "diff", "req": 2})
        assert w.message.startswith(f"branched {sandboxes[0]} into branch-{sandboxes[0]}-0 (paused ")
        wait_for(lambda: w.tree.get(f"branch-{sandboxes[0]}-0", {}).get("status") == "ready", what="branch")
        front_end_says(w, {"action": "branch", "id": sandboxes[0], "mode": "sideways", "req": 3})
        assert replies(w)[3]["ok"] is False and "unknown mode 'sideways'" in replies(w)[3]["message"]

        front_end_says(w, {"action": "kill", "id": sandboxes[1], "req": 4})
        assert w.message == f"killed {sandboxes[1]}"
        assert sandboxes[1] not in {b["id"] for b in ctl.list_sandboxes()}

        # delete with cascade takes the snapshots branched further down along
        branch = f"branch-{sandboxes[0]}-0"
        kid = ctl.spawn_sandboxes(branch, 1)[0]["id"]
        ctl.branch_sandbox(kid, "wa-deep", mode="full")
        # what the tree has shown becomes a tombstone (a node made and gone between two reads never was in it)
        wait_for(lambda: "wa-deep" in w.tree and kid in w.tree, what="wa-deep in the tree")
        front_end_says(w, {"action": "delete", "id": branch, "cascade": True, "req": 5})
        assert w.message == f"deleted {branch} and the snapshots branched from it"
        wait_for(lambda: all(w.tree.get(t, {}).get("status") == "deleted" for t in (branch, "wa-deep")),
                 what="deleted snapshots to be tombstones")
        # and stay so: a status the server sends after (a template ending as its snapshot goes) is late
        w.apply_event({"kind": "snapshot", "action": "status", "tag": branch, "status": "failed"})
        assert w.tree[branch]["status"] == "deleted" and w.tree[branch]["history"][-1] == "deleted"
        assert w.tree[kid]["status"] == "running"  # its sandbox keeps running, under its snapshot's tombstone
        assert w.tree[kid]["parent"] == branch
        # "clear gone" in the page: the kernel forgets its tombstones
        front_end_says(w, {"action": "clear", "req": 9})
        assert replies(w)[9]["ok"] and not any(n.get("tomb") for n in w.tree.values())
        assert branch not in w.tree and kid in w.tree

        # errors come back as one line in the widget and as a failed reply, nothing raises in the kernel
        front_end_says(w, {"action": "kill", "id": "sb-nope", "req": 6})
        assert w.message == "error: kill sb-nope: sandbox sb-nope not found"
        assert replies(w)[6] == {"reply": 6, "ok": False, "message": w.message}
        front_end_says(w, {"action": "explode", "id": "wa"})
        assert w.message == "error: unknown action 'explode'"
    finally:
        w.close()


def test_ping_and_reconnect(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("wh")
    w = LineageWidget(ctl)
    try:
        front_end_says(w, {"action": "ping", "req": 7})
        assert replies(w)[7] == {"reply": 7, "ok": True, "message": "pong"}
        w.stop()  # as when the stream was lost for good: the page shows "disconnected" and a button
        assert not w.live
        sb = ctl.spawn_sandboxes("wh", 1)[0]["id"]
        front_end_says(w, {"action": "reconnect", "req": 8})
        assert replies(w)[8]["ok"] and w.live and sb in w.tree
        sb2 = ctl.spawn_sandboxes("wh", 1)[0]["id"]
        wait_for(lambda: sb2 in w.tree, what="a change after reconnecting")
    finally:
        w.close()


def test_output_bundle_carries_a_static_picture(forkd, comms):
    ctl = forkd.controller()
    ctl.create_snapshot("wp")
    w = LineageWidget(ctl, live=False)
    try:
        data, _meta = w._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in data and data["text/plain"].startswith("LineageWidget(")
        svg = data["image/svg+xml"]
        assert svg.startswith("<svg") and "◆ wp · ready" in svg
        # the same picture as HTML, which JupyterLab renders where it does not run the widget (an
        # untrusted notebook: its SVG renderer is not a safe one, its sanitized HTML is)
        m = re.fullmatch(r'<img src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)">', data["text/html"])
        assert m and base64.b64decode(m.group(1)).decode() == svg
        assert html.unescape(m.group(2)) == "forkd lineage: 1 snapshot(s), 0 sandbox(es) when the cell ran"
    finally:
        w.close()


def test_a_node_that_only_leaves_the_scope_is_not_a_tombstone(forkd, comms):
    """A forkd kernel's HEAD is its notebook's: when the kernel moves on, the old HEAD leaves the
    notebook's tree but keeps running, so it is not drawn as killed."""
    ctl = forkd.controller()
    ctl.create_snapshot("wk")
    first, second = (b["id"] for b in ctl.spawn_sandboxes("wk", 2))
    ctl.set_kernel_head("k-wk", first)
    w = LineageWidget(ctl, scope=Scope(kernel_id="k-wk"))
    try:
        assert set(w.tree) == {"wk", first}
        ctl.set_kernel_head("k-wk", second)
        wait_for(lambda: second in w.tree and first not in w.tree, what="HEAD to move")
        ctl.kill_sandbox(second)
        wait_for(lambda: w.tree.get(second, {}).get("tomb"), what="the killed HEAD to be a tombstone")
        assert first not in w.tree
    finally:
        w.close()
        ctl.forget_kernel("k-wk")


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
def test_the_shared_drawing_pure_parts():
    """The drawing's pure parts (lineage_tree.js, shared by the widget and the lab panel) under node: ghosts, folded groups,
    search and filter, what a kill or delete takes along, counts and ages."""
    with tempfile.TemporaryDirectory() as d:
        mod = Path(d) / "lineage.mjs"
        mod.write_text(widget_esm())  # the module anywidget loads (the lab bundles the same files)
        script = f"""
        import * as L from {json.dumps(str(mod))};
        if (typeof L.default.render !== "function" || typeof L.LineageView !== "function") throw new Error("exports");
        const t = {{ py: {{kind: "snapshot", parent: null, status: "ready", lineage: ["py"]}},
                     b: {{kind: "snapshot", parent: "sb-a", status: "ready", lineage: ["py", "sb-a", "b"]}},
                     c: {{kind: "snapshot", parent: "sb-x", status: "ready", lineage: ["gone", "sb-x", "c"]}},
                     d: {{kind: "snapshot", parent: "sb-b", status: "ready", lineage: ["py", "sb-b", "d"]}} }};
        for (let i = 0; i < 5; i++) t["sb-" + i] = {{kind: "sandbox", parent: "py", status: "running", created: i,
                                                    lineage: ["py", "sb-" + i], memory: {{uss_kib: 1024}}}};
        t["sb-b"] = {{kind: "sandbox", parent: "py", status: "running", created: 9, lineage: ["py", "sb-b"]}};
        t["g"] = {{kind: "sandbox", parent: "b", status: "running", lineage: ["py", "sb-a", "b", "g"], heads: ["n.ipynb"]}};
        const full = L.withGhosts(t);
        const show = (rs) => rs.map(r => "  ".repeat(r.depth) + (r.type === "node" ? r.id : r.ids.length + "x" + r.status));
        console.log(JSON.stringify({{
          ghosts: Object.keys(full).filter(k => full[k].ghost).sort().map(k => [k, full[k].kind, full[k].parent, full[k].status]),
          rows: show(L.rows(full)),
          open: show(L.rows(full, {{expanded: new Set(["py|sandbox|running"])}})).length,
          search: show(L.rows(full, {{query: "SB-3"}})),
          only: show(L.rows(full, {{only: (id, n) => (n.heads || []).length > 0}})),
          kill: L.describeKill(full, "sb-b"),
          del: L.describeDelete(full, "py"),
          sum: L.summary(full),
          ages: [L.age(100, 105), L.age(0, 125), L.age(0, 7300), L.age(0, 90000), L.age(null, 1)],
          kib: [L.fmtKib(512), L.fmtKib(1536), L.fmtKib(3 * 1024 * 1024)],
        }}));
        """
        out = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # the killed sandboxes above branches and a deleted root come back as ghosts, so no branch floats
    assert got["ghosts"] == [["gone", "snapshot", None, "deleted"], ["sb-a", "sandbox", "py", "killed"],
                             ["sb-x", "sandbox", "gone", "killed"]]
    # five alike leaves under py fold into one row; the node with children and the HEAD stay out
    # (roots and siblings in order of creation, then id; ghosts have no creation time)
    assert got["rows"] == ["gone", "  sb-x", "    c", "py", "  5xrunning", "  sb-b", "    d",
                           "  sb-a", "    b", "      g"]
    assert got["open"] == len(got["rows"]) + 5
    assert got["search"] == ["py", "  sb-3"]  # a match and its ancestors, case-insensitive
    assert got["only"] == ["py", "  sb-a", "    b", "      g"]
    assert got["kill"]["title"] == "Kill sandbox sb-b?" and got["kill"]["ok"] == "Kill"
    assert "The 1 snapshot branched from it stays (d)" in " ".join(got["kill"]["body"])
    body = " ".join(got["del"]["body"])
    assert "The 6 sandboxes forked from it keep running (sb-0, sb-1, sb-2, sb-3, … (2 more))" in body
    assert "2 snapshots branched further down stay unless you tick the box: d, b." in body
    assert got["del"]["option"]["name"] == "cascade"
    assert got["sum"] == {"snapshots": 4, "sandboxes": 7, "memory_kib": 5120}
    assert got["ages"] == ["5s", "2m 5s", "2h 1m", "1d 1h", ""]
    assert got["kib"] == ["512 KiB", "1.5 MiB", "3.00 GiB"]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_shared_drawing_knows_the_hosts_behind_a_router():
    """Behind a fleet's router nodes carry ``host`` (a snapshot several hosts hold: ``hosts``): the
    drawing lists the hosts (a node's host is drawn only when there are several), shows them
    without the scheme, and the search finds a node by its host."""
    with tempfile.TemporaryDirectory() as d:
        mod = Path(d) / "lineage.mjs"
        mod.write_text(widget_esm())
        script = f"""
        import * as L from {json.dumps(str(mod))};
        const t = {{ py: {{kind: "snapshot", parent: null, status: "ready", host: "http://10.0.0.1:8889",
                          hosts: ["http://10.0.0.1:8889", "http://10.0.0.2:8889"]}},
                     "sb-1": {{kind: "sandbox", parent: "py", status: "running", host: "http://10.0.0.1:8889"}},
                     "sb-2": {{kind: "sandbox", parent: "py", status: "running", host: "http://10.0.0.2:8889"}},
                     "sb-3": {{kind: "sandbox", parent: "gone", status: "running", host: "https://[::1]:9/"}} }};
        const one = {{ py: {{kind: "snapshot", parent: null, status: "ready", host: "http://10.0.0.1:8889"}},
                       "sb-1": {{kind: "sandbox", parent: "py", status: "running", host: "http://10.0.0.1:8889"}} }};
        console.log(JSON.stringify({{
          hosts: L.hostsOf(L.withGhosts(t)), one: L.hostsOf(one), none: L.hostsOf({{a: {{kind: "snapshot", status: "ready"}}}}),
          label: L.hostLabel("https://[::1]:9/"),
          search: L.rows(L.withGhosts(t), {{query: "0.2:8889"}}).map(r => r.id),
        }}));
        """
        out = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["hosts"] == ["http://10.0.0.1:8889", "http://10.0.0.2:8889", "https://[::1]:9/"]
    assert got["one"] == ["http://10.0.0.1:8889"] and got["none"] == []
    assert got["label"] == "[::1]:9"
    assert got["search"] == ["py", "sb-2"]  # the snapshot held there too, and its sandbox there


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
