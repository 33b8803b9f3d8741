"""kill -9 of a sandbox, a template or the server: the registry stays true, nothing is orphaned."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from forkd_server.controller import recovery
from forkd_server.controller import Controller
from forkd_server.errors import Conflict, NotFound

from ..conftest import engine_processes, requires_root, wait_gone
from ..signals import signal_main_thread_until
from .conftest import cleanup, ev

pytestmark = requires_root

SERVER = textwrap.dedent("""
    import json, sys
    from forkd_server.controller import Controller
    c = Controller(sys.argv[1])
    def say(**kw):
        print(json.dumps(kw), flush=True)
    snap = c.create_snapshot("r", setup="value = 1")
    say(step="snapshot", tag=snap["tag"])
    kids = c.spawn("r", 3)
    say(step="spawned", ids=[k["id"] for k in kids])
    c.run_code(kids[0]["id"], "value = 2")
    b = c.branch(kids[0]["id"], "r-branch")
    say(step="branched", tag=b["tag"])
    for i in range(200):                 # keep working until killed
        say(step="spawning", round=i)
        more = c.spawn("r-branch", 5)
        say(step="spawned-more", round=i)
        for k in more:
            c.kill_sandbox(k["id"])
""")


def run_server(data_dir: str, stop_after: str, round_no: int = 0) -> list[dict]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, data_dir], stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:
            msg = json.loads(line)
            lines.append(msg)
            if msg["step"] == stop_after and msg.get("round", 0) == round_no:
                break
        else:
            pytest.fail(f"server exited before {stop_after}: {lines}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return lines


def assert_consistent(c: Controller) -> None:
    for snap in c.list_snapshots():
        assert snap["status"] in ("ready", "failed")
        if snap["status"] == "ready":
            c.spawn(snap["tag"], 1)  # a ready snapshot really forks
    for sb in c.list_sandboxes():
        assert c.ping(sb["id"])["pong"] is True
    assert c.registry._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_restart_reattaches_to_live_sandboxes_and_snapshots(short_dir):
    before = engine_processes(short_dir)
    lines = run_server(short_dir, "branched")
    ids = lines[1]["ids"]
    c = Controller(short_dir)
    try:
        assert {s["id"] for s in c.list_sandboxes()} == set(ids)
        assert ev(c, ids[0], "value") == "2" and ev(c, ids[1], "value") == "1"
        assert c.get_snapshot("r-branch")["status"] == "ready"
        g = c.spawn("r-branch", 1)[0]["id"]
        assert ev(c, g, "value") == "2"
        assert c.get_sandbox(ids[0])["branch_count"] == 1
        assert_consistent(c)
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


@pytest.mark.parametrize("stop_after", ["spawning", "spawned-more"])
def test_server_killed_mid_work_leaves_registry_consistent_and_no_orphans(short_dir, stop_after):
    before = engine_processes(short_dir)
    run_server(short_dir, stop_after, round_no=2)
    c = Controller(short_dir)
    try:
        assert_consistent(c)
        assert len(c.list_sandboxes()) >= 3
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


def test_kill_9_of_a_sandbox(short_dir):
    before = engine_processes(short_dir)
    c = Controller(short_dir)
    try:
        c.create_snapshot("k", setup="v = 5")
        a, b = c.spawn("k", 2)
        leaves = c.registry.get_sandbox(a["id"])["handle"]["cgroups"]
        os.kill(a["pid"], signal.SIGKILL)
        assert wait_gone({a["pid"]}) == set()
        with pytest.raises(NotFound):
            c.ping(a["id"])
        assert [s["id"] for s in c.list_sandboxes()] == [b["id"]]
        assert ev(c, b["id"], "v") == "5"
        assert not any(os.path.exists(leaf) for leaf in leaves)
        assert_consistent(c)
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


def test_kill_9_of_a_template(short_dir):
    before = engine_processes(short_dir)
    c = Controller(short_dir)
    try:
        c.create_snapshot("t", setup="v = 5")
        kids = c.spawn("t", 2)
        template_pid = c.registry.get_snapshot("t")["handle"]["pid"]
        os.kill(template_pid, signal.SIGKILL)
        assert wait_gone({template_pid}) == set()
        info = c.get_snapshot("t")
        assert info["status"] == "failed" and "killed by SIGKILL" in info["warning"], info
        with pytest.raises(Conflict, match="not bootable"):
            c.spawn("t", 1)
        # its sandboxes are nested in its pid namespace, which its init holds: they run on
        assert [ev(c, k["id"], "v") for k in kids] == ["5", "5"]
        assert_consistent(c)
    finally:
        cleanup(c)
        c.close()
    assert wait_gone(engine_processes(short_dir) - before) == set()


def test_a_reused_pid_is_not_mistaken_for_the_sandbox(short_dir):
    """The registry keeps pid + start time: the same pid with another start time is someone else."""
    c = Controller(short_dir)
    try:
        c.create_snapshot("p", setup="v = 1")
        sb = c.spawn("p", 1)[0]
        row = c.registry.get_sandbox(sb["id"])
        stranger = dict(row["handle"], start_time=row["handle"]["start_time"] + 1)
        c.registry.update_sandbox(sb["id"], handle=stranger)
        with pytest.raises(NotFound):
            c.ping(sb["id"])
        # forkd did not touch the process that now "owns" that pid
        assert os.path.exists(f"/proc/{sb['pid']}")
        os.kill(sb["pid"], signal.SIGKILL)
        assert wait_gone({sb["pid"]}) == set()
    finally:
        cleanup(c)
        c.close()


def test_killing_sandboxes_releases_the_engines_watchers(short_dir):
    """Every killed sandbox gives back its pidfd and socket: a long-lived server does not leak fds."""
    c = Controller(short_dir)
    try:
        c.create_snapshot("w", setup="x = 1")
        c.list_sandboxes()
        baseline = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            for sb in c.spawn("w", 10):
                c.ping(sb["id"])
                c.kill_sandbox(sb["id"])
        assert len(os.listdir("/proc/self/fd")) <= baseline + 1
        assert os.listdir(os.path.join(short_dir, "process", "run")) == [
            os.path.basename(c.registry.get_snapshot("w")["handle"]["socket"])]
    finally:
        cleanup(c)
        c.close()


def main_thread_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_deleting_a_snapshot_keeps_a_sandbox_whose_main_thread_ended(short_dir):
    """A process whose main thread has ended while its other threads run shows as a zombie ("Z").
    Deleting its snapshot must not take it along (nor may anything that misjudges it for dead).
    Here the sandbox stays in that state, so the case is certain."""
    c = Controller(short_dir)
    try:
        c.create_snapshot("z", setup="v = 7")
        sb = c.spawn("z", 1)[0]
        on_usr1_end_main_thread = (
            "import ctypes, signal\n"
            "signal.signal(signal.SIGUSR1, lambda *_: ctypes.CDLL(None).syscall(60, 0))  # SYS_exit\n")
        assert c.run_code(sb["id"], on_usr1_end_main_thread)["error"] is None
        # only now that the cell is answered: a main thread that ends during its cell never answers it
        signal_main_thread_until(sb["pid"], signal.SIGUSR1, lambda: main_thread_state(sb["pid"]) == "Z",
                                 "the sandbox's main thread ends")
        c.delete_snapshot("z")
        assert c.ping(sb["id"])["pong"] is True
        assert [s["id"] for s in c.list_sandboxes()] == [sb["id"]]
    finally:
        cleanup(c)
        c.close()


def test_restart_marks_what_is_alive_but_does_not_answer(short_dir, monkeypatch):
    """A process that lives but never answers (here: stopped) is not re-attached as ready or
    running: its snapshot becomes failed with the reason and its template is ended (its init
    holds the pid namespace its sandboxes live in: they run on), a silent sandbox is ended and
    dropped."""
    c = Controller(short_dir)
    try:
        c.create_snapshot("quiet", setup="v = 1")
        c.create_snapshot("fine", setup="v = 2")
        silent, healthy = c.spawn("fine", 2)
        child_of_quiet = c.spawn("quiet", 1)[0]
        template = c.registry.get_snapshot("quiet")["handle"]["pid"]
    finally:
        c.close()
    os.kill(template, signal.SIGSTOP)
    os.kill(silent["pid"], signal.SIGSTOP)
    monkeypatch.setattr(recovery, "PROBE_TIMEOUT", 1.0)
    try:
        c = Controller(short_dir)
        found = "\n".join(c.recovered["findings"])
        quiet = c.get_snapshot("quiet")
        assert quiet["status"] == "failed" and "did not answer" in quiet["warning"], quiet
        assert "its template was ended" in quiet["warning"] and wait_gone({template}) == set(), quiet
        assert f"sandbox {silent['id']}: it did not answer" in found
        assert wait_gone({silent["pid"]}) == set()
        assert {s["id"] for s in c.list_sandboxes()} == {healthy["id"], child_of_quiet["id"]}
        assert c.get_snapshot("fine")["status"] == "ready"
        assert ev(c, child_of_quiet["id"], "v") == "1"
        assert c.recovered["snapshots_failed"] == 1 and c.recovered["sandboxes_dropped"] == 1
        assert_consistent(c)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(template, signal.SIGCONT)
        cleanup(c)
        c.close()


def test_a_template_gone_at_start_up_is_lost_saying_why(short_dir):
    """A reboot ends every parked template: the next server lists such a snapshot ``lost`` (never
    silently missing), its warning saying that a process snapshot does not outlive a reboot."""
    c = Controller(short_dir)
    try:
        c.create_snapshot("gone", setup="v = 1")
        c.create_snapshot("kept", setup="v = 2")
        template = c.registry.get_snapshot("gone")["handle"]["pid"]
    finally:
        c.close()
    os.kill(template, signal.SIGKILL)
    assert wait_gone({template}) == set()
    c = Controller(short_dir)
    try:
        info = c.get_snapshot("gone")
        assert info["status"] == "lost" and not info["bootable"], info
        assert "does not outlive a reboot" in info["warning"] and "engine vm" in info["warning"]
        assert c.recovered["snapshots_lost"] == 1 and c.get_snapshot("kept")["status"] == "ready"
        with pytest.raises(Conflict, match="not bootable"):
            c.spawn("gone", 1)
        c.delete_snapshot("gone")  # a lost snapshot is deleted like any other
        assert_consistent(c)
    finally:
        cleanup(c)
        c.close()
