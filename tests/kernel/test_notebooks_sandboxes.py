"""A notebook's sandboxes, through a real forkd kernel on real sandboxes (its ``%forkd`` lines run in
the kernel's own IPython shell): a HEAD killed with ``kill -9`` leaves its branches and forks to go
on from, and nothing offers the dead one; a sandbox the notebook checks out becomes the notebook's
(its labels, its memory limit); after a restart, ``%forkd kill --all`` frees the old HEADs."""

from __future__ import annotations

import os
import re
import signal

from jupyter_client.manager import start_new_kernel

from forkd_engine import linux
from forkd_kernel.ownership import make_ours
from forkd_magics._scope import KERNEL_ID
from forkd_server.controller.checks import host_memory_mib
from forkd_server.client import Controller

from .cells import head_of, run


def kill_9(ctl: Controller, sandbox: str) -> None:
    """``kill -9`` of the pid the server gives for the sandbox, as a user would from a shell; returns
    once the process has ended, every thread of it (its pidfd turns readable then)."""
    pid = ctl.get_sandbox(sandbox)["pid"]
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        assert linux.wait_pidfd(pidfd, 30), f"{sandbox} (pid {pid}) did not end after SIGKILL"
    finally:
        os.close(pidfd)


def test_after_head_is_killed_its_branch_and_forks_go_on_and_nothing_offers_it(kernel, forkd_server):
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    assert run(kc, "x = 21").ok
    assert run(kc, "%forkd branch --live -t prekill").ok
    assert run(kc, "k = %forkd fork -n 2").ok
    dead = head_of(kc)
    kill_9(ctl, dead)

    # the fork branched HEAD once more, after prekill: its snapshot holds the latest state
    (forked,) = [s["tag"] for s in ctl.list_snapshots() if s.get("branched_from") == dead and s["tag"] != "prekill"]
    cell = run(kc, "x")  # the next cell says HEAD is gone, and which branch holds its latest state
    assert cell.content["ename"] == "SandboxGone"
    said = cell.content["evalue"]
    assert f"sandbox {dead} is gone" in said and "nothing was restarted" in said
    assert f"%forkd checkout {forked} continues from the latest branch taken of it" in said, said
    head = run(kc, "%forkd head")  # says the same: no dead sandbox passed off as HEAD
    assert head.content["ename"] == "UsageError" and f"{dead} is gone" in head.content["evalue"]
    assert f"%forkd checkout {forked}" in head.content["evalue"]
    assert run(kc, "%forkd log").content["evalue"] == head.content["evalue"].replace("forkd head:", "forkd log:")

    moved = run(kc, "%forkd checkout prekill")
    assert moved.ok, moved.text
    fresh = head_of(kc)
    assert f"HEAD: {dead} (gone) → {fresh}" in moved.text and "checkout - returns" not in moved.text
    assert run(kc, "x").result == "21"
    assert run(kc, "%forkd checkout k[0]").ok  # the forks taken before the kill run on
    assert run(kc, "x").result == "21"
    assert run(kc, "%forkd checkout -").ok and head_of(kc) == fresh

    # the way back never leads to a dead sandbox
    assert run(kc, "%forkd checkout k[1]").ok
    assert f"%forkd checkout - goes back to {fresh}" in run(kc, "%forkd head").result
    kill_9(ctl, fresh)
    assert "checkout - goes back" not in run(kc, "%forkd head").result
    log = run(kc, "%forkd log").result
    assert "← HEAD" in log and f"* {dead}  (gone)" in log  # how the notebook got here, the dead marked so
    back = run(kc, "%forkd checkout -")
    assert back.content["ename"] == "UsageError"
    assert back.content["evalue"] == (f"forkd checkout -: there is nowhere to go back to: {fresh} is gone\n"
                                      f"%forkd checkout TAG|SB moves the notebook (%forkd ls lists what there is)")
    gone = run(kc, f"%forkd checkout {dead}")  # named: the server's word on why it ended
    assert gone.content["ename"] == "UsageError"
    reason = said.partition("its variables with it: ")[2].partition("\n")[0]  # as the first cell said it
    assert gone.content["evalue"].startswith(f"forkd checkout: sandbox {dead} not found: {reason}")


def test_a_sandbox_checked_out_gets_the_notebooks_limit_and_labels(kernel, forkd_server):
    """As the lineage panel forks (POST /v1/sandboxes, the server's default limit) and then checks
    out: the notebook's next cells run with the notebook's limit, and it says so."""
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    host = host_memory_mib()
    assert run(kc, "x = 'state'").ok
    assert run(kc, "%forkd branch -t panelish").ok
    panel_fork = ctl.spawn_sandboxes("panelish", 1)[0]
    assert panel_fork["memory_limit_mib"] < host
    moved = run(kc, f"%forkd checkout {panel_fork['id']}")
    assert moved.ok, moved.text
    warned = "".join(c["text"] for c in moved.of("stream") if c["name"] == "stderr")
    assert warned == (f"forkd: {panel_fork['id']} had a memory limit of {panel_fork['memory_limit_mib']} MiB, "
                      f"lower than this notebook's: raised to {host} MiB (its /tmp and /dev/shm keep their sizes).\n")
    assert ctl.get_sandbox(panel_fork["id"])["memory_limit_mib"] == host
    assert run(kc, "x").result == "'state'"
    again = run(kc, "%forkd checkout -")  # back to its own sandbox, which has the notebook's: nothing to say
    assert again.ok and not [c for c in again.of("stream") if c["name"] == "stderr"]
    # a sandbox of a snapshot made elsewhere, without the notebook's labels, gets them too
    ctl.create_snapshot("made-elsewhere", setup="y = 2")
    other = ctl.spawn_sandboxes("made-elsewhere", 1)[0]["id"]
    assert KERNEL_ID not in ctl.get_sandbox(other)["labels"]
    assert run(kc, f"%forkd checkout {other}").ok
    assert ctl.get_sandbox(other)["labels"][KERNEL_ID] == ctl.get_sandbox(panel_fork["id"])["labels"][KERNEL_ID]


def test_a_limit_the_server_cannot_raise_is_a_warning(forkd_server):
    """A notebook whose limit is past what the server allows (a server on a smaller host): the
    checkout goes on, says the sandbox keeps its lower limit, and still labels it."""
    ctl = Controller(forkd_server.url, forkd_server.token)
    ctl.create_snapshot("small-host", setup="x = 1")
    sb = ctl.spawn_sandboxes("small-host", 1, memory_limit_mib=300)[0]
    try:
        said = make_ours(ctl, sb, {KERNEL_ID: "k-big"}, host_memory_mib() + 4096)
        assert len(said) == 1 and said[0].startswith(f"forkd: warning: {sb['id']} keeps its memory limit of 300 MiB")
        assert "the server could not raise it (memory_limit_mib" in said[0]
        now = ctl.get_sandbox(sb["id"])
        assert now["memory_limit_mib"] == 300 and now["labels"][KERNEL_ID] == "k-big"
    finally:
        ctl.kill_sandbox(sb["id"])
        ctl.delete_snapshot("small-host")


def test_after_a_restart_kill_all_frees_the_old_heads(kernel, forkd_server):
    km, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    first = head_of(kc)
    assert KERNEL_ID in ctl.get_sandbox(first)["labels"]
    ctl.create_snapshot("outside-nb", setup="z = 3")  # made elsewhere (the SDK): none of the notebook's labels
    outside = ctl.spawn_sandboxes("outside-nb", 1)[0]["id"]
    assert run(kc, f"%forkd checkout {outside}").ok
    km.restart_kernel(now=False)
    kc.wait_for_ready(timeout=60)
    notice = run(kc, "1")
    assert outside in notice.text and f"%forkd kill {outside}" in notice.text
    fresh = head_of(kc)
    killed = run(kc, "%forkd kill --all")
    assert killed.ok, killed.text
    running = {s["id"] for s in ctl.list_sandboxes()}
    assert first not in running and outside not in running and fresh in running  # HEAD itself stays
    assert re.match(r"killed [2-9]\d* sandboxes", killed.text)


def test_checking_out_another_notebooks_head_warns_that_they_share_it(kernel, forkd_server):
    """Two notebooks in one sandbox share its variables: a cell in either changes them for both. The
    checkout goes on (the other kernel may be gone without a word) but says so, and how to get a copy."""
    _, kc = kernel
    km2, other = start_new_kernel(kernel_name="forkd-python")
    try:
        assert run(other, "x = 'theirs'").ok
        theirs = head_of(other)
        moved = run(kc, f"%forkd checkout {theirs}")
        assert moved.ok, moved.text
        warned = "".join(c["text"] for c in moved.of("stream") if c["name"] == "stderr")
        assert warned.startswith(f"forkd: warning: {theirs} is also the HEAD of kernel "), warned
        assert "the two notebooks share its variables now" in warned, warned
        assert f"kids = %forkd fork {theirs} -n 1, then %forkd checkout kids[0]" in warned, warned
        assert run(kc, "x").result == "'theirs'"
    finally:
        other.stop_channels()
        km2.shutdown_kernel(now=False)


def test_display_works_in_a_checked_out_sandbox_of_a_plain_snapshot(kernel, forkd_server):
    """A snapshot made outside the kernel (``%forkd snapshot``, the SDK) ran its setup without the
    notebook's shell; checked out, its ``display()`` showed nothing at all (the setup runner's own
    display was left in the namespace, sending to a runner long gone)."""
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    ctl.create_snapshot("plain-setup", setup="y = 2")
    assert run(kc, "%forkd checkout plain-setup").ok
    shown = run(kc, "display('shown'); y")
    assert [c["data"]["text/plain"] for c in shown.of("display_data")] == ["'shown'"], shown.text
    assert shown.result == "2"
