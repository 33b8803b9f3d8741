"""`forkd demo` (the README's first command) runs end to end and its own checks hold."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import engine_processes, requires_root, wait_gone


@requires_root
def test_forkd_demo_runs_and_cleans_up(short_dir):
    out = subprocess.run([sys.executable, "-m", "forkd_server.cli", "demo", "--mib", "32", "--children", "4",
                          "--grandchildren", "2", "--json", "--data-dir", short_dir],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["source_result_unchanged"] and figures["state_carried_to_grandchildren"]
    assert figures["children_random_streams_distinct"]
    assert figures["branch_pause_ms"] > 0 and figures["spawn_total_ms"] > 0
    assert "lineage of demo-" in out.stdout and "cleaned up" in out.stdout
    assert wait_gone(engine_processes(short_dir)) == set()  # no sandbox left behind


def test_a_demo_that_cannot_run_says_why_in_one_line(monkeypatch, capsys):
    """Where no engine can run (e.g. a Python environment under /tmp, which every sandbox replaces), the demo
    ends in one line saying why and a status, not a traceback; --debug adds the traceback."""
    from forkd_server.cli import main
    from forkd_server.controller import Controller

    def no_engines(self):
        self.unavailable["process"] = "the Python environment at /tmp/v lies under /tmp, which every sandbox replaces"
        return {}

    monkeypatch.setattr(Controller, "_default_engines", no_engines)
    assert main(["demo", "--mib", "8"]) == 1
    err = capsys.readouterr().err
    assert err == ("forkd demo: engine 'process' is not available on this server (the Python environment at /tmp/v "
                   "lies under /tmp, which every sandbox replaces); `forkd doctor` checks what this host has for "
                   "each engine\n")
    assert main(["demo", "--mib", "8", "--debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("forkd demo: engine 'process' is not available") and "Traceback (most recent call last)" in err
