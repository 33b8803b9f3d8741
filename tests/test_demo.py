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
