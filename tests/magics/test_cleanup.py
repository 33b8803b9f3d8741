"""Cleaning up through the magics in a real IPython shell: ``kill --everyone`` alone, ``delete`` of
several tags, and a bulk ``delete`` that keeps (and names) the base snapshot a forkd kernel forks
from, with the way to delete it anyway."""

from __future__ import annotations

import pytest
from jupyter_client.manager import start_new_kernel

from .conftest import cell, in_notebook


def test_kill_everyone_alone_kills_every_notebooks_sandboxes(ip, forkd):
    in_notebook(ip, "kernel-a", "a.ipynb")
    ip.run_line_magic("forkd", "snapshot -t ka")
    ip.run_line_magic("forkd", "fork -t ka -n 2")
    in_notebook(ip, "kernel-b", "b.ipynb")
    ip.run_line_magic("forkd", "fork -t ka -n 1")
    forkd.controller().spawn_sandboxes("ka", 1)  # and one made outside any notebook
    res, out = cell(ip, "%forkd kill --everyone")
    assert res.success and out.stdout == "killed 4 sandboxes\n", out.stderr
    assert forkd.controller().list_sandboxes() == []
    res, out = cell(ip, "%forkd kill")
    assert not res.success and "--everyone" in str(res.error_in_exec)  # the usage names it


def test_delete_takes_several_tags_and_goes_on_past_a_failure(ip, forkd):
    for tag in ("d1", "d2", "d3"):
        ip.run_line_magic("forkd", f"snapshot -t {tag}")
    assert cell(ip, "snap = %forkd snapshot -t d4")[0].success
    res, out = cell(ip, "%forkd delete d1 nosuch d2 snap")  # a variable holding a Snapshot too
    assert out.stdout == "deleted 3 snapshots\n"
    assert not res.success
    assert str(res.error_in_exec).startswith("forkd delete: could not delete 1 of 4:\n  nosuch: ")
    assert [s["tag"] for s in forkd.controller().list_snapshots()] == ["d3"]
    res, out = cell(ip, "%forkd delete d3 --all")
    assert not res.success and "name snapshots (TAG ...), or use --all" in str(res.error_in_exec)


@pytest.fixture
def forkd_kernel(forkd):
    """A real forkd kernel on the test's server: it makes its base snapshot and registers it."""
    km, kc = start_new_kernel(kernel_name="forkd-python", env=forkd.env)
    try:
        reply = kc.execute_interactive("1 + 1", timeout=120)
        assert reply["content"]["status"] == "ok"
        yield km
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_a_bulk_delete_keeps_a_running_kernels_base_and_names_it(ip, forkd, forkd_kernel):
    ctl = forkd.controller()
    (kernel,) = ctl.list_kernels()
    base = kernel["base_snapshot"]
    assert ctl.snapshot_info(base)["status"] == "ready"
    in_notebook(ip, "kernel-c", "c.ipynb")
    ip.run_line_magic("forkd", "snapshot -t mine")
    res, out = cell(ip, "%forkd delete --everyone")
    assert res.success, out.stderr
    assert out.stdout == (f"deleted 1 snapshot\nkept {base}: the base snapshot of the forkd kernel of kernel "
                          f"{kernel['kernel_id'][:8]}, which a restart forks from; %forkd delete {base} deletes it "
                          f"by name\n")
    assert [s["tag"] for s in ctl.list_snapshots()] == [base]

    # a base branched from another snapshot: --cascade of that one would take the base along
    ip.run_line_magic("forkd", "snapshot -t root")
    sb = ctl.spawn_sandboxes("root", 1)[0]["id"]
    ctl.branch_sandbox(sb, "branched-base")
    ctl.branch_sandbox(sb, "plain-branch")
    ctl.set_kernel_head("kernel-d", sb, base_snapshot="branched-base", notebook="d.ipynb")
    try:
        res, out = cell(ip, "%forkd delete --all --everyone --cascade")
        assert res.success, out.stderr
        assert out.stdout.splitlines() == [
            "deleted 1 snapshot",  # plain-branch
            ("kept branched-base: the base snapshot of the forkd kernel of d.ipynb, which a restart forks from; "
             "%forkd delete branched-base deletes it by name"),
            (f"kept {base}: the base snapshot of the forkd kernel of kernel {kernel['kernel_id'][:8]}, which a "
             f"restart forks from; %forkd delete {base} deletes it by name"),
            ("kept root: a forkd kernel's base snapshot was branched from it, and --cascade would take that along; "
             "%forkd delete root deletes it by name")]
    finally:
        ctl.forget_kernel("kernel-d")
        ctl.kill_sandbox(sb)

    res, out = cell(ip, f"%forkd delete {base} branched-base root")  # by name: deleted, and said what it was
    assert res.success, out.stderr
    assert out.stdout.startswith(f"deleted 3 snapshots\n{base} was the base snapshot of the forkd kernel of kernel")
    assert ctl.list_snapshots() == []
