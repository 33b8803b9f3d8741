"""The VM restore line: what the host builds is what the guest agent parses (no JSON on that path)."""

from __future__ import annotations

import time

import pytest

from forkd_engine.agent.serial import parse_restore
from forkd_engine.vm.channel import restore_request


def test_round_trip_of_identity_entropy_and_clock():
    identity = {"id": "sb-0001-ü", "role": "sandbox", "lineage": ["base", "branch-sb-1-0", "sb-0001-ü"]}
    before = time.time_ns()
    line = restore_request(identity)("a1b2c3d4-7")
    assert line.endswith(b"\n") and b"{" not in line
    rid, entropy, host_ns, got = parse_restore(line.rstrip(b"\n"))
    assert rid == "a1b2c3d4-7" and len(entropy) == 64
    assert before <= host_ns <= time.time_ns()
    assert got == {"id": "sb-0001-ü", "role": "sandbox", "hostname": "sb-0001", "lineage": identity["lineage"]}


def test_every_line_draws_fresh_entropy_and_empty_lineage_survives():
    a = parse_restore(restore_request({"id": "t", "role": "template"})("r-1").rstrip(b"\n"))
    b = parse_restore(restore_request({"id": "t", "role": "template"})("r-2").rstrip(b"\n"))
    assert a[1] != b[1] and a[3]["lineage"] == [] and a[3]["hostname"] == "t"


def test_a_malformed_line_is_an_error():
    with pytest.raises(ValueError):
        parse_restore(b"restore r-1 zz 12 00 00 00 00")


def test_an_armed_timer_is_user_work_a_run_ahead_would_start():
    """A pooled guest runs ahead only when nothing of the user's would run (serial.quiet): an alarm
    or interval timer the setup left armed would fire there and run its handler, so it counts. In a
    process of its own: pytest's timeout arms one in this one."""
    import subprocess
    import sys
    probe = """
import signal
from forkd_engine.agent.serial import timers_armed
seen = [timers_armed()]
signal.signal(signal.SIGALRM, lambda *_: None)
signal.setitimer(signal.ITIMER_REAL, 3600)
seen.append(timers_armed())
signal.setitimer(signal.ITIMER_REAL, 0)
seen.append(timers_armed())
signal.alarm(3600)
seen.append(timers_armed())
signal.alarm(0)
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[False, True, False, True]", out.stderr
