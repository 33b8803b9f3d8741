"""A spawn's children, forked in the template's C loop (process/fanout.c): each one whole.

Each child's first process is PID 1 of a pid namespace of its own and has become forkd-init; the
agent is its child, PID 2 there; both are in the child's own leaves, with its limits; each agent
set itself up in the loop (its own namespaces, hostname, lo, and none of its siblings' descriptors),
and idles there, answering pings, until its first other request; a fresh sandbox starts its
compactor's thread only once a cell has run, and reaps on its accepting thread.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from forkd_engine.process import fanout
from forkd_server.errors import Gone, NotFound

from ..conftest import requires_root
from .conftest import ev

pytestmark = requires_root


def _status(pid: int, key: str) -> list[str]:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1:] for line in f if line.startswith(key + ":"))


def _wait_threads(pid: int, count: int, timeout: float = 10) -> int:
    """The agent's number of threads once it is ``count`` (a connection's thread ends after its reply)."""
    deadline = time.monotonic() + timeout
    while (now := len(os.listdir(f"/proc/{pid}/task"))) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_each_child_is_an_init_and_its_agent_in_leaves_of_their_own(ctl, snap):
    assert os.path.exists(fanout.build())  # the loop the templates load
    kids = ctl.spawn(snap, 12, memory_limit_mib=256)
    try:
        namespaces = set()
        for kid in kids:
            handle = ctl.registry.get_sandbox(kid["id"])["handle"]
            agent, init = handle["pid"], handle["init"]["pid"]
            assert _status(agent, "PPid") == [str(init)]
            with open(f"/proc/{init}/comm") as f:
                assert f.read().strip() == "forkd-init"
            assert _status(init, "NSpid")[-1] == "1" and _status(agent, "NSpid")[-1] == "2"
            namespaces.add(os.readlink(f"/proc/{agent}/ns/pid"))
            leaves = handle["cgroups"]
            assert leaves and all(os.path.basename(leaf) == kid["id"] for leaf in leaves)
            for leaf in leaves:
                with open(os.path.join(leaf, "cgroup.procs")) as f:
                    assert {str(agent), str(init)} <= set(f.read().split())
            memory = [leaf for leaf in leaves if os.path.exists(os.path.join(leaf, "memory.limit_in_bytes"))
                      or os.path.exists(os.path.join(leaf, "memory.max"))]
            for leaf in memory:
                name = "memory.max" if os.path.exists(os.path.join(leaf, "memory.max")) else "memory.limit_in_bytes"
                with open(os.path.join(leaf, name)) as f:
                    assert int(f.read()) == 256 << 20
            assert ev(ctl, kid["id"], "counter") == "41"  # the snapshot's state
        assert len(namespaces) == len(kids)
    finally:
        for kid in kids:
            ctl.kill_sandbox(kid["id"])


@pytest.fixture(scope="module")
def quiet(ctl):
    """A snapshot with little in /tmp: its children idle in the loop until first used."""
    return ctl.create_snapshot("quiet", setup="import numpy\ncounter = 41\n"
                                              "open('/tmp/small', 'w').write('from the setup')")["tag"]


def test_an_idle_child_answers_pings_from_the_loop_until_its_first_request(ctl, quiet):
    heavy = ctl.create_snapshot("tmp-heavy", setup="open('/tmp/big', 'wb').write(bytes(2 << 20))")["tag"]
    copier = ctl.spawn(heavy, 1)[0]  # it copies its 2 MiB of /tmp before it reports, not at its first use
    ctl.ping(copier["id"])
    assert _wait_threads(ctl.registry.get_sandbox(copier["id"])["handle"]["pid"], 2) == 2
    ctl.kill_sandbox(copier["id"])
    ctl.delete_snapshot(heavy)
    kid = ctl.spawn(quiet, 1)[0]
    try:
        pid = ctl.registry.get_sandbox(kid["id"])["handle"]["pid"]
        first = ctl.ping(kid["id"])
        os.kill(pid, signal.SIGINT)  # interrupts nothing, as between a sandbox's cells
        assert ctl.ping(kid["id"])["uptime_s"] >= first["uptime_s"]
        assert _wait_threads(pid, 1) == 1  # still in the C loop: no Python thread started
        assert ctl.run_code(kid["id"], "x = 1")["exit_code"] == 0
        # Python's own answer is the loop's, but for the time since the fork, which went on.
        python = ctl.ping(kid["id"])
        assert python.pop("uptime_s") >= first.pop("uptime_s") and python == first
        assert first["pid"] == 2 and first["sandbox_id"] == kid["id"] and first["busy"] is None
        # Then the main thread (cells), the accepting thread (and reaper), the compactor (after a cell).
        assert _wait_threads(pid, 3) == 3
        assert "forkd-compact" in ev(ctl, kid["id"], "[t.name for t in __import__('threading').enumerate()]")
    finally:
        ctl.kill_sandbox(kid["id"])


def test_an_idle_childs_tmp_is_copied_at_its_first_use_and_its_own(ctl, quiet):
    a, b = (k["id"] for k in ctl.spawn(quiet, 2))
    try:
        assert ev(ctl, a, "open('/tmp/small').read()") == "'from the setup'"
        assert ev(ctl, a, "open('/tmp/small', 'w').write('a was here')") == "10"
        assert ev(ctl, b, "open('/tmp/small').read()") == "'from the setup'"  # b copied the template's, not a's
        later = ctl.spawn(quiet, 1)[0]["id"]
        assert ev(ctl, later, "open('/tmp/small').read()") == "'from the setup'"
        ctl.kill_sandbox(later)
    finally:
        for kid in (a, b):
            ctl.kill_sandbox(kid)


def test_an_idle_child_that_cannot_set_itself_up_says_so_and_ends(ctl):
    # The snapshot's own code breaks what a child runs at its first request (/tmp's private copy).
    tag = ctl.create_snapshot("no-copies", setup="import forkd_engine.process.inside as inside\n"
                                                 "def refused(*args):\n    raise OSError('no room for a copy')\n"
                                                 "inside.private_copy = refused")["tag"]
    try:
        kid = ctl.spawn(tag, 1)[0]["id"]
        assert ctl.ping(kid)["pong"] is True  # idle: nothing tried yet
        reply = ctl.eval(kid, "1")
        assert reply["exit_code"] == 1
        assert reply["error"] == f"{kid} could not set itself up after its spawn: OSError: no room for a copy"
        with pytest.raises((NotFound, Gone), match="exited with status 1"):
            ctl.ping(kid)
    finally:
        ctl.delete_snapshot(tag)


def test_a_branch_is_an_idle_childs_first_request(ctl, quiet):
    kid = ctl.spawn(quiet, 1)[0]["id"]
    try:
        tag = ctl.branch(kid)["tag"]  # the child leaves the loop for it, then forks as any sandbox does
        grand = ctl.spawn(tag, 2)
        assert [ev(ctl, g["id"], "counter") for g in grand] == ["41", "41"]
        assert len({ev(ctl, g["id"], "__import__('random').random()") for g in grand}) == 2
        assert ev(ctl, kid, "counter + 1") == "42"
        for g in grand:
            ctl.kill_sandbox(g["id"])
        ctl.delete_snapshot(tag)
    finally:
        ctl.kill_sandbox(kid)


def _line(conn: socket.socket) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        data = conn.recv(65536)
        assert data, "the agent closed the connection"
        buf += data
    return json.loads(buf)


def test_connections_held_while_idle_are_served_after_the_first_request(ctl, quiet):
    """Kept connections (the server's pings), a ping sent in two pieces, a ping with descriptors and
    one spelled otherwise all reach Python whole when the child leaves the loop."""
    kid = ctl.spawn(quiet, 1)[0]
    try:
        path = ctl.registry.get_sandbox(kid["id"])["handle"]["socket"]
        kept, quiet, split = (socket.socket(socket.AF_UNIX) for _ in range(3))
        for conn in (kept, quiet, split):
            conn.settimeout(30)
            conn.connect(path)
        for spelling in (b'{"action":"ping"}\n', b'{"action": "ping"}\n'):
            kept.sendall(spelling)
            assert _line(kept)["sandbox_id"] == kid["id"]
        r, w = os.pipe()
        socket.send_fds(kept, [b'{"action":"ping"}\n'], [r])  # a ping takes none: closed, not kept
        assert _line(kept)["pong"] is True
        agent = ctl.registry.get_sandbox(kid["id"])["handle"]["pid"]
        split.sendall(b'{"action":')  # not all here: the child leaves the loop for Python to read it
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{agent}/task")) == 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(os.listdir(f"/proc/{agent}/task")) > 1
        split.sendall(b'"ping", "x": 1}\n')
        assert _line(split)["pong"] is True
        kept.sendall(b'{"action":"eval","code":"6 * 7"}\n')
        assert _line(kept)["result"] == "42"
        quiet.sendall(b'{"action":"ping"}\n')  # accepted in the loop, first used by Python
        assert _line(quiet)["pong"] is True
        for conn in (kept, quiet, split):
            conn.close()
        os.close(w)
        os.close(r)
    finally:
        ctl.kill_sandbox(kid["id"])


def _zombie_children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and fields[1] == str(pid):
            found.append(int(name))
    return found


def test_a_sandbox_reaps_its_ended_branch_on_its_accepting_thread(ctl, snap):
    kid = ctl.spawn(snap, 1)[0]
    try:
        agent = ctl.registry.get_sandbox(kid["id"])["handle"]["pid"]
        ctl.branch(kid["id"], "reaped-branch")
        branch_init = ctl.registry.get_snapshot("reaped-branch")["handle"]["init"]["pid"]
        assert _status(branch_init, "PPid") == [str(agent)]  # the sandbox's own fork
        ctl.delete_snapshot("reaped-branch")                 # it ends: a zombie until the sandbox reaps it
        deadline = time.monotonic() + 30
        while (os.path.exists(f"/proc/{branch_init}") or _zombie_children(agent)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{branch_init}") and _zombie_children(agent) == []
        threads = ev(ctl, kid["id"], "[t.name for t in __import__('threading').enumerate()]")
        assert "forkd-accept" in threads and "forkd-reaper" not in threads  # reaped by the accepting thread
    finally:
        ctl.kill_sandbox(kid["id"])


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def test_each_agent_has_its_own_namespaces_hostname_lo_and_descriptors(ctl, snap):
    template = ctl.registry.get_snapshot(snap)["handle"]["pid"]
    kids = ctl.spawn(snap, 4)
    try:
        seen = {kind: {os.readlink(f"/proc/{template}/ns/{kind}")} for kind in ("mnt", "uts", "ipc", "net")}
        sockets = []
        for kid in kids:
            agent = ctl.registry.get_sandbox(kid["id"])["handle"]["pid"]
            for kind in seen:
                ns = os.readlink(f"/proc/{agent}/ns/{kind}")
                assert ns not in seen[kind], f"{kid['id']} shares its {kind} namespace"
                seen[kind].add(ns)
            assert ev(ctl, kid["id"], "__import__('socket').gethostname()") == repr(kid["id"][:64])
            assert ev(ctl, kid["id"], "(__import__('os').getpid(), __import__('os').readlink('/proc/self'))") == "(2, '2')"
            lo = ("import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
                  "c = socket.create_connection(s.getsockname(), timeout=5); c.close(); s.close()\n'up'")
            assert ctl.run_code(kid["id"], lo)["result"]["text/plain"] == "'up'"
            sockets.append(_socket_inodes(agent))
        for i, mine in enumerate(sockets):  # no agent holds a sibling's listener or the template's
            assert not mine & _socket_inodes(template)
            assert all(not mine & other for other in sockets[i + 1:])
    finally:
        for kid in kids:
            ctl.kill_sandbox(kid["id"])

