"""The forkd kernel on real sandboxes: the notebook itself branches, forks and checks out."""

from __future__ import annotations

import ast
import os
import re
import threading
import time
from unittest import mock

import pytest
from jupyter_client.manager import start_new_kernel

from forkd_server.client import Controller

from .cells import head_of, printed, run, run_interrupted


def test_branch_fork_checkout_and_back(kernel):
    _, kc = kernel
    first = run(kc, "x = 21")
    assert first.ok
    branch = run(kc, "%forkd branch --live")
    assert branch.ok and "Snapshot(" in branch.result and "status='ready'" in branch.result
    assert run(kc, "kids = %forkd fork -n 5").ok
    used = run(kc, "len(kids)")  # kids lives in the kernel: the cell says so and how to use it
    assert used.content["ename"] == "NameError"
    assert "forkd: 'kids' was bound by a %forkd line, so it lives in the kernel, not in the notebook's sandbox" \
        in used.text and "%%forkd run kids" in used.text
    ids = re.search(r"as a value: kids = (\[.*\])$", used.text, re.M)  # Python that runs in the sandbox
    assert ids and len(ast.literal_eval(ids[1])) == 5 and run(kc, f"kids = {ids[1]}; len(kids)").result == "5"
    assert run(kc, "%forkd checkout kids[2]").ok
    plus = run(kc, "x + 1")
    assert plus.result == "22"
    assert plus.count == first.count + 6  # the counter went on: nothing restarted at In[1]
    assert run(kc, "x = 99").ok
    assert run(kc, "grand = %forkd fork -n 1").ok
    assert run(kc, "%forkd checkout grand[0]").ok
    assert run(kc, "x").result == "99"
    log = run(kc, "%forkd log").result
    assert "x = 99" in log and "x = 21" in log and "← HEAD" in log
    assert run(kc, "%forkd checkout -").ok
    assert run(kc, "%forkd checkout -").ok
    assert run(kc, "x").result == "21"
    # gone back through both checkouts: said so, not that there was none
    back = run(kc, "%forkd checkout -")
    assert back.content["evalue"] == ("forkd checkout -: there is nowhere to go back to (no checkout left to go "
                                      "back from)\n%forkd checkout TAG|SB moves the notebook (%forkd ls lists what "
                                      "there is)")
    assert run(kc, "h = %forkd head").ok  # no sandbox: %%forkd run is no way to use it
    used = run(kc, "h")
    assert "forkd: 'h' was bound by a %forkd line" in used.text and "%%forkd run h" not in used.text, used.text
    missing = run(kc, "%forkd kill nokids")  # a %forkd argument that names nothing: Python's own error type
    assert missing.content["ename"] == "NameError" and missing.content["traceback"] == [
        f"\x1b[0;31mNameError\x1b[0m: {missing.content['evalue']}"], missing.content


def test_forks_of_the_notebook_draw_their_own_random_numbers(kernel):
    _, kc = kernel
    assert run(kc, "import random").ok
    assert run(kc, "kids = %forkd fork -n 5").ok
    drawn = run(kc, "%%forkd run kids\nrandom.random()")
    assert drawn.ok, drawn.text
    values = re.findall(r"\]\n(0\.\d+)", drawn.result)
    assert len(values) == 5 and len(set(values)) == 5, drawn.result


def test_interrupt_stops_a_sleeping_cell_and_keeps_the_state(kernel):
    km, kc = kernel
    assert run(kc, "state = 'kept'").ok
    t0 = time.monotonic()
    cell = run_interrupted(km, kc, "import time\nprint('sleeping', flush=True)\ntime.sleep(60)", printed("sleeping"))
    assert time.monotonic() - t0 < 30  # the sleep was cut short (how soon: bench/kernel.py, "interrupt")
    assert cell.content["status"] == "error" and cell.content["ename"] == "KeyboardInterrupt"
    assert run(kc, "state").result == "'kept'"


def test_interrupt_while_the_cell_floods_output_stops_it(kernel):
    """An interrupt that reaches the kernel while it forwards the cell's output (not while it waits
    for the next message) still stops the cell in the sandbox, and the cell still gets its reply."""
    km, kc = kernel
    code = "import itertools\nfor i in itertools.count():\n    print(i, flush=True)"
    past_zero = lambda msg: msg["msg_type"] == "stream" and any(  # noqa: E731 - i has gone past 0
        line.strip() not in ("", "0") for line in msg["content"]["text"].splitlines())
    for _ in range(3):  # each interrupt lands wherever the kernel is: mostly forwarding output here
        t0 = time.monotonic()
        cell = run_interrupted(km, kc, code, past_zero)
        assert time.monotonic() - t0 < 30
        assert cell.content["status"] == "error" and cell.content["ename"] == "KeyboardInterrupt", cell.content
    assert run(kc, "i > 0").result == "True"


def test_input_round_trip(kernel):
    _, kc = kernel
    asked = []

    def answer(msg):
        asked.append(msg["content"]["prompt"])
        kc.input("ada")

    cell = run(kc, "name = input('who? ')\nname.upper()", allow_stdin=True, stdin_hook=answer)
    assert asked == ["who? "] and cell.result == "'ADA'"


def test_interrupt_while_the_cell_waits_for_input_stops_it(kernel):
    km, kc = kernel
    cell = run(kc, "name = input('who? ')", allow_stdin=True, stdin_hook=lambda msg: km.interrupt_kernel())
    assert cell.content["status"] == "error" and cell.content["ename"] == "KeyboardInterrupt", cell.content
    assert run(kc, "1 + 1").result == "2"


def test_getpass_round_trip_asks_for_a_password(kernel):
    _, kc = kernel
    asked = []

    def answer(msg):
        asked.append((msg["content"]["prompt"], msg["content"]["password"]))
        kc.input("s3cret")

    cell = run(kc, "import getpass\npin = getpass.getpass('pin? ')\n(len(pin), pin == 's3cret')",
               allow_stdin=True, stdin_hook=answer)
    assert asked == [("pin? ", True)]  # the frontend hides what is typed
    assert cell.result == "(6, True)" and "s3cret" not in cell.text


def test_checkout_of_a_tag_is_a_fresh_child_holding_its_state(kernel, forkd_server):
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    assert run(kc, "x = 'at the tag'").ok
    assert run(kc, "%forkd branch -t good-run").result == "Snapshot('good-run', status='ready')"
    before = head_of(kc)
    assert run(kc, "x = 'moved on'").ok
    known = {s["id"] for s in ctl.list_sandboxes()}
    moved = run(kc, "%forkd checkout good-run")  # a tag with a dash: not read as good minus run
    assert moved.ok, moved.text
    new = head_of(kc)
    assert new not in known and ctl.get_sandbox(new)["snapshot_tag"] == "good-run"  # a new sandbox
    assert f"HEAD: {before} → {new}" in moved.text
    assert run(kc, "x").result == "'at the tag'"
    assert run(kc, "%forkd checkout good-run").ok  # again: another fresh child, not the same one
    assert head_of(kc) not in known | {new}
    assert run(kc, "%forkd checkout -").ok and head_of(kc) == new
    assert run(kc, "%forkd checkout -").ok and head_of(kc) == before
    assert run(kc, "x").result == "'moved on'"  # the source kept its own state
    wrong = run(kc, "%forkd checkout nosuch[0]")
    assert wrong.content["ename"] == "UsageError" and "name 'nosuch' is not defined" in wrong.content["evalue"]


def test_checkout_of_a_tag_still_being_written_waits_until_it_is_ready(kernel, forkd_server):
    """``%forkd checkout TAG`` of a snapshot asked for a moment ago (``branch --no-wait``, a creation
    still in its setup) waits until it is ready: it failed, 'not bootable: status=writing'."""
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    made = threading.Thread(target=ctl.create_snapshot, args=("slow-tag",),
                            kwargs={"setup": "import time; time.sleep(3); x = 7"})
    made.start()
    try:
        deadline = time.monotonic() + 30
        while not any(s["tag"] == "slow-tag" for s in ctl.list_snapshots()):  # asked for: being written
            assert time.monotonic() < deadline, "the snapshot was never listed"
            time.sleep(0.05)
        moved = run(kc, "%forkd checkout slow-tag")
        assert moved.ok, moved.text
        assert run(kc, "x").result == "7"
    finally:
        made.join()

def test_branch_no_wait_and_diff_of_head(kernel, forkd_server):
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    assert run(kc, "x = 'first'").ok
    quick = run(kc, "%forkd branch --no-wait")
    assert quick.ok, quick.text
    m = re.fullmatch(r"Snapshot\('(branch-sb-[\w-]+)', status='(writing|ready)'\)", quick.result or "")
    assert m, quick.result  # returned at once, maybe still writing
    assert ctl.wait_snapshot(m.group(1), timeout=60)["status"] == "ready"
    assert run(kc, "x = 'second'").ok
    assert run(kc, "%forkd branch --diff -t diffed").result == "Snapshot('diffed', status='ready')"
    assert run(kc, "x = 'third'").ok
    for tag, state in ((m.group(1), "'first'"), ("diffed", "'second'")):
        assert run(kc, f"%forkd checkout {tag}").ok
        assert run(kc, "x").result == state


def test_widgets_round_trip_through_comms(kernel):
    _, kc = kernel
    shown = run(kc, "import ipywidgets\nslider = ipywidgets.IntSlider(value=1)\nslider")
    assert shown.ok, shown.text
    opened = [c for c in shown.of("comm_open") if c.get("target_name") == "jupyter.widget"]
    model = next(c for c in opened if c["data"]["state"].get("_model_name") == "IntSliderModel")
    assert any("application/vnd.jupyter.widget-view+json" in c["data"] for c in shown.of("execute_result"))
    # The frontend moves the slider: the value changes in the sandbox.
    msg = kc.session.msg("comm_msg", {"comm_id": model["comm_id"],
                                      "data": {"method": "update", "state": {"value": 7}, "buffer_paths": []}})
    kc.shell_channel.send(msg)
    assert run(kc, "slider.value").result == "7"
    # Checking out another sandbox closes the widgets of the one left behind.
    assert run(kc, "kids = %forkd fork -n 1").ok
    moved = run(kc, "%forkd checkout kids[0]")
    assert model["comm_id"] in {c["comm_id"] for c in moved.of("comm_close")}


def test_a_killed_head_is_an_error_naming_it_never_a_fresh_start(kernel, forkd_server):
    _, kc = kernel
    assert run(kc, "y = 1").ok
    head = head_of(kc)
    Controller(forkd_server.url, forkd_server.token).kill_sandbox(head)
    cell = run(kc, "y")
    assert cell.content["status"] == "error"
    assert head in cell.content["evalue"] and "%forkd checkout" in cell.content["evalue"]
    assert cell.count > 2  # not In[1]


def test_a_head_killed_by_its_memory_limit_says_so(forkd_server):
    """A notebook whose limit is low (a checkout raises a sandbox's limit to the notebook's, so the
    notebook's own is the one to meet)."""
    km, kc = start_new_kernel(kernel_name="forkd-python", env={**os.environ, "FORKD_KERNEL_MEMORY_LIMIT_MIB": "256"})
    try:
        head = head_of(kc)
        cell = run(kc, "blob = b'x' * (400 * 2**20)")
        assert cell.content["status"] == "error"
        what, hint = cell.content["evalue"].split("\n")  # what happened, what to do
        assert what == f"this notebook's sandbox {head} is gone, and its variables with it: it died of its memory limit (256 MiB)"
        assert hint.startswith("nothing was restarted in its place: %forkd checkout ")
        (details,) = cell.of("display_data")  # the rest, collapsed under the error
        html = details["data"]["text/html"]
        assert html.startswith("<details") and "memory limit was reached (256 MiB)" in html
        assert "--memory-limit-mib 512" in html and "$FORKD_KERNEL_MEMORY_LIMIT_MIB" in html
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_restart_starts_fresh_and_says_where_the_old_state_is(kernel, forkd_server):
    km, kc = kernel
    assert run(kc, "z = 'old'").ok
    old_head = head_of(kc)
    km.restart_kernel(now=False)
    kc.wait_for_ready(timeout=60)
    fresh = run(kc, "'z' in dir()")
    assert fresh.result == "False"
    assert old_head in fresh.text and f"%forkd checkout {old_head}" in fresh.text
    assert run(kc, f"%forkd checkout {old_head}").ok
    assert run(kc, "z").result == "'old'"


def test_a_notebook_whose_kernel_stopped_with_its_server_starts_fresh_saying_where_its_state_is(forkd_server):
    """What forkd keeps when a Jupyter server stops its kernels (KernelHeads.leave, called as the
    extension stops: tests/lab/test_panel.py shows it) reaches the notebook's next kernel: it starts
    fresh, as any kernel would, but its first cell names the sandbox that still runs with the state."""
    import sqlite3

    ctl = Controller(forkd_server.url, forkd_server.token)
    tag = f"left-{os.getpid()}"
    ctl.create_snapshot(tag, setup="z = 'kept'")
    old = ctl.spawn_sandboxes(tag, 1)[0]["id"]
    db = sqlite3.connect(os.path.join(forkd_server.server.data_dir, "registry.sqlite3"), timeout=30)
    with db:  # what leave() records for a kernel of work/left.ipynb its Jupyter server stopped
        db.execute("INSERT INTO kernels_left (notebook, head, kernel_id, left_at) VALUES (?, ?, ?, ?)",
                   ("work/left.ipynb", old, "stopped-kernel", time.time()))
    db.close()
    with mock.patch.dict(os.environ, JPY_SESSION_NAME="work/left.ipynb"):
        km, kc = start_new_kernel(kernel_name="forkd-python")
    try:
        first = run(kc, "'z' in dir()")
        assert first.result == "False"
        assert "stopped with the Jupyter server" in first.text and f"%forkd checkout {old}" in first.text, first.text
        assert run(kc, f"%forkd checkout {old}").ok
        assert run(kc, "z").result == "'kept'"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
        ctl.kill_sandbox(old)
        ctl.delete_snapshot(tag, cascade=True)


def test_a_cell_mixing_forkd_lines_and_python_is_refused(kernel):
    _, kc = kernel
    cell = run(kc, "a = 1\n%forkd ls")
    assert cell.content["ename"] == "UsageError" and "cell of their own" in cell.content["evalue"]


def test_forkd_run_streams_and_interrupt_stops_every_sandbox(kernel):
    km, kc = kernel
    assert run(kc, "import time").ok
    assert run(kc, "kids = %forkd fork -n 3").ok
    t0 = time.monotonic()
    # interrupted once every column shows 'started': each of the three runs its cell by then
    cell = run_interrupted(km, kc, "%%forkd run kids\nprint('started', flush=True)\ntime.sleep(60)",
                           lambda msg: msg["content"].get("data", {}).get("text/plain", "").count("started") == 3,
                           timeout=40)
    assert time.monotonic() - t0 < 40
    assert cell.content["status"] == "error" and cell.content["ename"] == "KeyboardInterrupt"  # as ipykernel's
    assert cell.content["evalue"] == "forkd run: interrupted; the cell stopped in 3 of 3 sandboxes", cell.content
    # the columns were drawn while the cells ran: shown (first drawn, or updated; on a loaded host all
    # three may have started by the first drawing) with 'started' before they gave way to the result
    kinds = [m["msg_type"] for m in cell.messages]
    before_end = cell.messages[:kinds.index("clear_output")] if "clear_output" in kinds else []
    live = [m for m in before_end if m["msg_type"] in ("display_data", "update_display_data")
            and "started" in m["content"]["data"].get("text/plain", "")]
    assert live, kinds
    assert run(kc, "%forkd exec {kids[0].id} -- true").ok  # the sandboxes serve again


def test_a_server_restart_loses_nothing(kernel, forkd_server):
    _, kc = kernel
    assert run(kc, "kept = [1, 2, 3]").ok
    forkd_server.server.crash_and_restart()
    cell = run(kc, "sum(kept)")
    assert cell.result == "6" and "reconnected to" in cell.text
    assert run(kc, "%forkd branch --live").ok  # the server side works again too


def test_a_cell_run_while_the_sandbox_is_still_being_made_runs_when_it_is_ready(forkd_server):
    # A base snapshot whose setup takes a while (another base, since the setup differs).
    km, kc = start_new_kernel(kernel_name="forkd-python",
                              env={**__import__("os").environ, "FORKD_KERNEL_SETUP": "import time\ntime.sleep(3)"})
    try:
        info = kc.kernel_info(reply=True, timeout=5)  # answered at once, while the sandbox is made
        assert info["content"]["implementation"] == "forkd"
        cell = run(kc, "'ready'", timeout=120)
        assert cell.result == "'ready'"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_forkd_tree_marks_head(kernel):
    _, kc = kernel
    assert run(kc, "a = 1").ok
    tree = run(kc, "%forkd tree --static")
    assert tree.ok, tree.text
    head = head_of(kc)
    svg = next(m["content"]["data"]["image/svg+xml"] for m in tree.messages
               if m["msg_type"] in ("execute_result", "display_data") and "image/svg+xml" in m["content"]["data"])
    assert f"{head} · running · HEAD of" in svg


THREAD = ("import threading, time\n"
          "ticker = threading.Thread(target=lambda: time.sleep(3600), name='ticker', daemon=True)\n"
          "ticker.start()")


def test_a_running_thread_refuses_the_branch_until_lossy_then_warns(kernel):
    _, kc = kernel
    assert run(kc, "x = 5\n" + THREAD).ok
    refused = run(kc, "%forkd branch --live")
    assert refused.content["status"] == "error"
    assert "ticker" in refused.text and "--lossy" in refused.text  # what, and the way out
    done = run(kc, "s = %forkd branch --live --lossy")
    assert done.ok, done.text
    assert "ForkWarning" in done.text and "ticker" in done.text  # said under the cell
    assert run(kc, "kids = %forkd fork -n 1 --lossy").ok
    assert run(kc, "%forkd checkout kids[0]").ok
    assert run(kc, "(x, ticker.is_alive())").result == "(5, False)"  # the state; the thread stayed behind


def test_a_setup_that_leaves_a_thread_says_why_on_the_process_engine(forkd_server):
    km, kc = start_new_kernel(kernel_name="forkd-python",
                              env={**os.environ, "FORKD_KERNEL_ENGINE": "process", "FORKD_KERNEL_SETUP": THREAD})
    try:
        cell = run(kc, "1 + 1")
        assert cell.content["status"] == "error"
        assert "ticker" in cell.text and "VM engine" in cell.text
        assert "could not be made" not in cell.text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_the_notebooks_sandboxes_have_its_memory_limit_not_the_servers_default(kernel, forkd_server):
    """Pages a notebook shares with the branches it keeps stay charged to it, so its sandboxes get
    the host's memory as their limit, not the 2048 MiB every other sandbox gets."""
    from forkd_engine.process.engine import DEFAULT_MEMORY_LIMIT_MIB

    from forkd_server.controller.checks import host_memory_mib
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    host = host_memory_mib()

    def limits_of_new(line: str) -> list[int]:
        before = {s["id"] for s in ctl.list_sandboxes()}
        cell = run(kc, line)
        assert cell.ok, cell.text
        return sorted(s["memory_limit_mib"] for s in ctl.list_sandboxes() if s["id"] not in before)

    assert ctl.get_sandbox(head_of(kc))["memory_limit_mib"] == host
    assert run(kc, "%forkd branch -t limits").ok
    assert limits_of_new("copies = %forkd fork -n 2") == [host, host]            # copies of the notebook
    assert limits_of_new("small = %forkd fork -n 1 --memory-limit-mib 300") == [300]  # as asked
    assert limits_of_new("others = %forkd fork -t limits -n 1") == [DEFAULT_MEMORY_LIMIT_MIB]  # of a tag: the server's
    assert limits_of_new("%forkd checkout limits") == [host]                      # a fresh child: HEAD


@pytest.mark.parametrize("env, want", [("", "host"), ("host", "host"), (" 700 ", 700)])
def test_the_memory_limit_is_the_servers_hosts_unless_set(monkeypatch, env, want):
    """Unset, the kernel asks for "host", which the server that runs the sandbox resolves: a kernel
    on a machine with more memory than its server's (or behind a fleet's router) is not refused."""
    from forkd_kernel.kernel import ForkdKernel
    monkeypatch.setenv("FORKD_KERNEL_MEMORY_LIMIT_MIB", env)
    assert ForkdKernel._memory_limit(None) == want


@pytest.mark.parametrize("value", ["700", "lots"])
def test_the_memory_limit_is_configurable_and_a_bad_value_says_so(forkd_server, value):
    km, kc = start_new_kernel(kernel_name="forkd-python", env={**os.environ, "FORKD_KERNEL_MEMORY_LIMIT_MIB": value})
    try:
        if value == "lots":
            cell = run(kc, "1 + 1")
            assert cell.content["ename"] == "ForkdKernelError"
            assert ("$FORKD_KERNEL_MEMORY_LIMIT_MIB='lots' is neither a whole number of MiB nor \"host\""
                    in cell.content["evalue"])
        else:
            head = head_of(kc)
            assert Controller(forkd_server.url, forkd_server.token).get_sandbox(head)["memory_limit_mib"] == 700
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_a_forkd_url_that_names_no_server_is_said_under_the_first_cell():
    """$FORKD_URL without its scheme: the kernel starts and says so, rather than dying at start."""
    km, kc = start_new_kernel(kernel_name="forkd-python", env={**os.environ, "FORKD_URL": "localhost:8889"})
    try:
        cell = run(kc, "1 + 1")
        assert cell.content["ename"] == "ForkdKernelError"
        assert "could not start its sandbox: not a forkd server's URL: 'localhost:8889'" in cell.content["evalue"]
        assert "restart the kernel" in cell.content["evalue"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_the_log_marks_a_deleted_snapshot_of_the_lineage(kernel):
    """%forkd log marks the sandboxes of the lineage that are gone; a snapshot deleted since is
    marked too, not listed as if it were there to check out."""
    _, kc = kernel
    assert run(kc, "x = 1").ok
    assert run(kc, "%forkd branch -t log-br").ok
    assert run(kc, "%forkd checkout log-br").ok
    assert run(kc, "%forkd delete log-br").ok
    log = run(kc, "%forkd log").result
    assert "  snapshot log-br  (deleted)" in log.splitlines(), log
