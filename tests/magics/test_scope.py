"""Labels and "this notebook": what the magics create carries the notebook's kernel id and path (the
keys the JupyterLab panel filters by), and ls / kill --all / delete --all / tree act on that notebook
unless --everyone says otherwise. First in a real ipykernel started as jupyter_server starts one, then
two notebooks side by side in one shell."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest
from IPython.lib.pretty import pretty
from jupyter_client.manager import KernelManager

from forkd_magics._scope import KERNEL_ID, NOTEBOOK
from forkd_server.client import ControllerError

from ..conftest import completed
from .conftest import cell, in_notebook


@pytest.fixture
def kernel(forkd):
    """An ipykernel as jupyter_server starts a notebook's: connection file kernel-<id>.json, the
    notebook's path in $JPY_SESSION_NAME."""
    runtime = tempfile.mkdtemp(prefix="fkrt")
    kernel_id = str(uuid.uuid4())
    km = KernelManager(kernel_name="python3", connection_file=os.path.join(runtime, f"kernel-{kernel_id}.json"))
    km.start_kernel(env={**forkd.env, "JPY_SESSION_NAME": "work/scoped.ipynb"})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield kernel_id, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        shutil.rmtree(runtime, ignore_errors=True)


def run(kc, code: str) -> str:
    """Execute in the kernel; its stdout and stderr (and error) as one text."""
    out = []

    def hook(msg):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] == "error":
            out.append(f"{content['ename']}: {content['evalue']}")

    reply = kc.execute_interactive(code, timeout=120, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def test_a_notebook_kernel_labels_what_it_makes_and_completes_forkd_lines(forkd, kernel):
    kernel_id, kc = kernel
    run(kc, "%load_ext forkd_magics\n"
            "snap = %forkd snapshot -t sk  # made by this notebook\n"
            "kids = %forkd fork -t sk -n 2\n"
            "br = %forkd branch {kids[0].id} -t sk-b\n"
            "grand = br.fork(1)  # the SDK, no labels of its own: it inherits them")
    mine = {KERNEL_ID: kernel_id, NOTEBOOK: "work/scoped.ipynb"}
    ctl = forkd.controller()
    assert {s["tag"]: s["labels"] for s in ctl.list_snapshots()} == {"sk": mine, "sk-b": mine}
    assert [s["labels"] for s in ctl.list_sandboxes()] == [mine] * 3
    assert len(ctl.list_sandboxes(labels={NOTEBOOK: "work/scoped.ipynb"})) == 3
    assert ctl.list_sandboxes(labels={NOTEBOOK: "elsewhere.ipynb"}) == []
    assert run(kc, "listing = %forkd ls\nprint(listing.scope)") == "this notebook (work/scoped.ipynb)\n"

    # tab completion as JupyterLab asks for it (complete_request)
    reply = kc.complete("%forkd ki", cursor_pos=9, reply=True, timeout=30)["content"]
    assert reply["matches"] == ["kill"]
    tags = completed(lambda: kc.complete("%forkd fork -t sk", cursor_pos=17, reply=True, timeout=30)["content"]
                     ["matches"], {"sk", "sk-b"})
    assert sorted(tags) == ["sk", "sk-b"]
    assert run(kc, "%forkd kill --all\n%forkd delete --all") == "killed 3 sandboxes\ndeleted 2 snapshots\n"


def test_ls_kill_delete_and_tree_mean_this_notebook_until_everyone(ip, forkd):
    in_notebook(ip, "kernel-a", "a.ipynb")
    ip.run_line_magic("forkd", "snapshot -t sa")
    kids_a = ip.run_line_magic("forkd", "fork -t sa -n 2")
    ip.run_line_magic("forkd", f"branch {kids_a[0].id} -t sa-b")

    in_notebook(ip, "kernel-b", "b.ipynb")
    ip.run_line_magic("forkd", "snapshot -t sb0")
    (kid_b,) = ip.run_line_magic("forkd", "fork -t sb0")
    (kid_b_of_a,) = ip.run_line_magic("forkd", "fork -t sa")  # b forks a's snapshot: the child is b's
    assert kid_b_of_a.labels == {KERNEL_ID: "kernel-b", NOTEBOOK: "b.ipynb"}
    branch = ip.run_line_magic("forkd", f"branch {kid_b_of_a.id} -t sb-of-a")
    assert branch.labels == {KERNEL_ID: "kernel-b", NOTEBOOK: "b.ipynb"}

    listing = ip.run_line_magic("forkd", "ls")
    assert sorted(s.tag for s in listing.snapshots) == ["sb-of-a", "sb0"]
    assert sorted(b.id for b in listing.sandboxes) == sorted([kid_b.id, kid_b_of_a.id])
    assert pretty(listing).startswith("2 snapshot(s) of this notebook (b.ipynb)\n")
    everyone = ip.run_line_magic("forkd", "ls --everyone")
    assert len(everyone.snapshots) == 4 and len(everyone.sandboxes) == 4

    tree = ip.run_line_magic("forkd", "tree --static")
    # b's nodes, and a's snapshot as the ancestor of b's child (the lineage stays whole)
    assert set(tree.tree) == {"sb0", kid_b.id, "sa", kid_b_of_a.id, "sb-of-a"}
    assert "of this notebook (b.ipynb)" in repr(tree)
    assert len(ip.run_line_magic("forkd", "tree --static --everyone").tree) == 8

    in_notebook(ip, "kernel-a", "a.ipynb")
    res, out = cell(ip, "%forkd kill --all")
    assert res.success and out.stdout == "killed 2 sandboxes\n"
    assert {b["id"] for b in forkd.controller().list_sandboxes()} == {kid_b.id, kid_b_of_a.id}
    in_notebook(ip, "kernel-a2", "a.ipynb")  # the same notebook after a kernel restart: still its own
    assert sorted(s.tag for s in ip.run_line_magic("forkd", "ls").snapshots) == ["sa", "sa-b"]
    res, out = cell(ip, "%forkd delete --all")  # deepest first
    assert res.success and out.stdout == "deleted 2 snapshots\n"
    assert sorted(s["tag"] for s in forkd.controller().list_snapshots()) == ["sb-of-a", "sb0"]  # b's stay
    # deleting the snapshot b's child was forked from ends none of b's sandboxes
    assert {b["id"] for b in forkd.controller().list_sandboxes()} == {kid_b.id, kid_b_of_a.id}, \
        [ended(forkd, sid) for sid in (kid_b.id, kid_b_of_a.id)]

    res, out = cell(ip, "%forkd kill --all --everyone\n%forkd delete --all --everyone")
    assert res.success and out.stdout == "killed 2 sandboxes\ndeleted 2 snapshots\n", out.stderr


def ended(forkd, sandbox_id: str) -> str:
    """What the server says of a sandbox: running, or when and why it ended."""
    try:
        return f"{sandbox_id}: {forkd.controller().get_sandbox(sandbox_id)['status']}"
    except ControllerError as exc:
        return str(exc)
