"""The %forkd magics, driven through a real IPython shell against a real ``forkd serve``."""

from __future__ import annotations

import pytest
from IPython.lib.pretty import pretty

from forkd_magics._magics import SUBCOMMANDS, ExecResult, ForkdMagics, Listing
from forkd_magics._render import RunResults
from forkd_server.client import Sandbox, Snapshot

from .conftest import cell


def test_load_ext_registers_line_and_cell_magic_idempotently(shell):
    shell.run_line_magic("reload_ext", "forkd_magics")
    shell.run_line_magic("load_ext", "forkd_magics")
    magics = shell.magics_manager.magics
    assert "forkd" in magics["line"] and "forkd" in magics["cell"]


def test_snapshot_fork_run_branch_grandchildren(ip, forkd):
    snap = ip.run_line_magic("forkd", 'snapshot -t mq --setup "counter = 0; data = list(range(10))"')
    assert isinstance(snap, Snapshot) and snap.tag == "mq" and snap.status == "ready"

    kids = ip.run_line_magic("forkd", "fork -t mq -n 3")
    assert [type(k) for k in kids] == [Sandbox] * 3
    assert {b["id"] for b in forkd.controller().list_sandboxes()} == {k.id for k in kids}
    ip.user_ns["kids"] = kids

    # the cell runs in every sandbox of the list variable, outputs per sandbox, in order
    res, out = cell(ip, "%%forkd run kids\ncounter += 1\nprint('counter', counter)\nsum(data)")
    assert res.success, out.stderr
    runs = res.result
    assert isinstance(runs, RunResults) and list(runs) == [k.id for k in kids]
    assert all(ex.stdout == "counter 1\n" and ex.text == "45" for ex in runs.values())
    html = runs._repr_html_()
    assert html.count("counter 1") == 3 and all(k.id in html for k in kids) and "display:grid" in html

    # branch kids[0]: grandchildren inherit its counter; its siblings are untouched
    br = ip.run_line_magic("forkd", f"branch {kids[0].id} -t mq-b")
    assert isinstance(br, Snapshot) and br.status == "ready" and br.branched_from == kids[0].id
    ip.user_ns["grand"] = ip.run_line_magic("forkd", "fork -t mq-b -n 2")
    res, _ = cell(ip, "%%forkd run grand\ncounter += 10\ncounter")
    assert [ex.text for ex in res.result.values()] == ["11", "11"]
    res, _ = cell(ip, f"%%forkd run {kids[1].id}\ncounter")
    assert res.result[kids[1].id].text == "1"


def test_run_targets_by_tag_and_all_and_rich_outputs(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t ta")
    ip.run_line_magic("forkd", "snapshot -t tb")
    a = ip.run_line_magic("forkd", "fork -t ta -n 2")
    b = ip.run_line_magic("forkd", "fork -t tb -n 1")
    res, _ = cell(ip, "%%forkd run --tag ta\nimport os\nos.environ.get('HOSTNAME', 'x') and 1")
    assert sorted(res.result) == sorted(s.id for s in a)
    res, _ = cell(ip, "%%forkd run --all\nclass R:\n    def _repr_html_(self): return '<b>rich</b>'\nR()")
    assert sorted(res.result) == sorted(s.id for s in a + b)
    html = res.result._repr_html_()
    assert html.count("<b>rich</b>") == 3  # text/html bundles are shown as HTML, not escaped
    # an exception is shown in its sandbox's column as one line, every column is shown, and then
    # the cell fails: a run that failed somewhere never counts as a success
    res, out = cell(ip, f"%%forkd run {a[0].id} {b[0].id}\n1/0")
    assert not res.success
    assert "the cell failed in 2 of 2 sandboxes" in out.stderr and "ZeroDivisionError" in out.stderr
    shown = out.outputs[-1].data["text/plain"]  # the columns, shown before the cell fails
    assert shown.count("ZeroDivisionError: division by zero") == 2 and a[0].id in shown


def test_branch_no_wait_is_live_and_becomes_ready(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t nw")
    (sb,) = ip.run_line_magic("forkd", "fork -t nw")
    br = ip.run_line_magic("forkd", f"branch {sb.id} --no-wait")
    assert br.tag == f"branch-{sb.id}-0" and br.status in ("writing", "ready")
    assert br.pause_ms is not None
    assert br.wait(30).status == "ready"
    info = next(s for s in forkd.controller().list_snapshots() if s["tag"] == br.tag)
    assert info["branched_from"] == sb.id


def test_ls_exec_kill(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t lk")
    kids = ip.run_line_magic("forkd", "fork -t lk -n 3")
    listing = ip.run_line_magic("forkd", "ls")
    assert isinstance(listing, Listing)
    assert [s.tag for s in listing.snapshots] == ["lk"] and len(listing.sandboxes) == 3
    text = pretty(listing)
    assert "1 snapshot(s)" in text and "3 sandbox(es)" in text and kids[2].id in text

    r = ip.run_line_magic("forkd", f"exec {kids[0].id} -- echo hi && echo oops >&2; exit 3")
    assert isinstance(r, ExecResult)
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "oops\n", 3)
    assert pretty(r) == "hi\noops\n[exit code 3]"

    ip.user_ns["victim"] = kids[0]
    _, out = cell(ip, "%forkd kill victim")
    assert out.stdout == "killed 1 sandbox\n"
    assert {b["id"] for b in forkd.controller().list_sandboxes()} == {kids[1].id, kids[2].id}
    _, out = cell(ip, "%forkd kill --tag lk")
    assert out.stdout == "killed 2 sandboxes\n"
    assert forkd.controller().list_sandboxes() == []


def test_delete_snapshot(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t del1")
    _, out = cell(ip, "%forkd delete del1")
    assert out.stdout == "deleted snapshot del1\n"
    assert forkd.controller().list_snapshots() == []


def test_freeze_wake_and_store_move_a_sandbox_down_the_tiers(ip, forkd):
    ip.run_line_magic("forkd", 'snapshot -t tier --setup "x = 41"')
    (kid,) = ip.run_line_magic("forkd", "fork -t tier")
    ip.user_ns["kid"] = kid
    _, out = cell(ip, "%forkd freeze kid")
    assert out.stdout == f"{kid.id}: frozen\n"
    assert forkd.controller().get_sandbox(kid.id)["tier"] == "frozen"
    _, out = cell(ip, f"%forkd wake {kid.id}")
    assert out.stdout.startswith(f"{kid.id}: running (woken from frozen in ") and out.stdout.endswith(" ms)\n")
    _, out = cell(ip, "%forkd wake kid")
    assert out.stdout == f"{kid.id}: running (it was running: nothing to wake)\n"
    _, out = cell(ip, "%forkd freeze kid")
    res, _ = cell(ip, "%%forkd run kid\nx + 1")  # any call wakes it
    assert res.result[kid.id].text == "42" and forkd.controller().get_sandbox(kid.id)["tier"] == "running"
    # the process engine's deepest tier is frozen: store says so, in two lines
    res, out = cell(ip, "%forkd store kid")
    assert not res.success and out.stderr.startswith("UsageError: forkd store: "), out.stderr
    assert "freeze" in out.stderr and "vm" in out.stderr and out.stderr.count("\n") <= 2, out.stderr


def test_a_wake_from_stored_is_said_with_its_split():
    from forkd_magics._tiers import tier_line
    woke = {"id": "sb-1", "tier": "running", "wake": {"from": "stored", "ms": 812.4, "fetch_ms": 3.2,
                                                       "decompress_ms": 640.0, "restore_ms": 169.1}}
    assert tier_line(woke) == "sb-1: running (woken from stored in 812 ms: fetch 3, decompress 640, restore 169 ms)"
    assert tier_line({"id": "sb-1", "tier": "stored"}) == "sb-1: stored"


@pytest.mark.parametrize("line, message", [
    ("fork -t nope", "UsageError: forkd fork: snapshot nope not found\n"),
    ("kill sb-nope", "UsageError: forkd kill: sb-nope: no such sandbox is running (killed already, or a wrong id)"),
    ("frobnicate", "UsageError: forkd: unknown subcommand 'frobnicate'"),
    ("fork -n 2", 'UsageError: forkd fork: this notebook runs in a plain kernel, not in a sandbox\nuse the '
                  '"Python 3 (forkd)" kernel'),
    ("branch --live", 'UsageError: forkd branch: this notebook runs in a plain kernel'),
    ("checkout sb-x", 'UsageError: forkd checkout: this notebook runs in a plain kernel'),
    ("branch sb-x --diff --live", "UsageError: forkd branch: --diff and --live exclude each other"),
    ("run sb-x", "UsageError: forkd run is a cell magic"),
    ("exec sb-x", "UsageError: forkd exec: give a command"),
    ("wake sb-nope", "UsageError: forkd wake: sandbox sb-nope not found"),
    ("freeze two", "UsageError: forkd freeze: two names 2 sandboxes; give exactly one"),
    ("branch two", "UsageError: forkd branch: two names 2 sandboxes; give exactly one"),
    ("snapshot -t pk --engine process --package python3-numpy", "UsageError: forkd snapshot: packages need engine vm"),
    ("snapshot -t pk --package Bad_Name", "UsageError: forkd snapshot: 'Bad_Name' is not a Debian package name"),
])
def test_errors_are_two_lines_at_most_not_a_traceback(ip, line, message):
    ip.user_ns["two"] = [Sandbox({"id": "sb-a", "snapshot_tag": "t"}), Sandbox({"id": "sb-b", "snapshot_tag": "t"})]
    res, out = cell(ip, f"%forkd {line}")
    assert not res.success
    assert out.stderr.startswith(message), out.stderr
    assert out.stderr.count("\n") <= 2 and "Traceback" not in out.stderr + out.stdout


def test_a_url_that_names_no_server_is_one_line(shell, monkeypatch):
    monkeypatch.setenv("FORKD_TOKEN", "t" * 32)
    shell.register_magics(ForkdMagics(shell))
    res, out = cell(shell, "%forkd connect localhost:8889")  # no scheme: was a traceback
    assert not res.success
    assert out.stderr.startswith("UsageError: forkd connect: not a forkd server's URL: 'localhost:8889'")
    assert "Traceback" not in out.stderr + out.stdout


def test_unreachable_server_is_one_line(shell, monkeypatch):
    monkeypatch.setenv("FORKD_URL", "http://127.0.0.1:9")
    shell.register_magics(ForkdMagics(shell))
    res, out = cell(shell, "%forkd ls")
    assert not res.success
    assert out.stderr.startswith("UsageError: forkd ls: no forkd server answers at http://127.0.0.1:9")
    assert "Traceback" not in out.stderr


def test_help_is_plain_text_from_magic_arguments(ip):
    """%forkd? shows the magic's docstring (as IPython shows any magic's) and %forkd help prints it:
    plain text, not the reST IPython writes for Sphinx (no ``::`` blocks, no ``<ARG>``)."""
    doc = ip.find_line_magic("forkd").__doc__
    for name in SUBCOMMANDS:
        prefix = "%%forkd" if name == "run" else "%forkd"
        assert f"\n{prefix} {name}" in doc  # each subcommand's usage line starts a line
    assert "--no-wait" in doc and "--tag TAG, -t TAG" in doc
    assert "::" not in doc and "<" not in doc.replace("branch-<id>-<n>", "")
    assert max(len(line) for line in doc.splitlines()) <= 105  # wrapped, not one line per paragraph
    _, out = cell(ip, "%forkd help")
    assert out.stdout == doc + "\n"
    _, out = cell(ip, "%forkd branch --help")
    usage = out.stdout.split("\n\n")[0]
    assert usage == "%forkd branch [--tag TAG] [--diff] [--live] [--no-wait] [--lossy] [sandbox]"
    _, out = cell(ip, "%forkd run --help")
    assert out.stdout.startswith("%%forkd run [--tag TAG]")
