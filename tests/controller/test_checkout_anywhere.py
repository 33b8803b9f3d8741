"""forkd's code may lie under /tmp (a checkout there), though every sandbox mounts its own /tmp:
the engine binds it below /.forkd-code and the sandbox imports it from there, including what the
agent imports only once the sandbox runs (the notebook's IPython shell)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ..conftest import engine_processes, requires_root, wait_gone

REPO = Path(__file__).parents[2]

SCRIPT = textwrap.dedent("""
    import ast, json, os, sys
    from forkd_server.controller import Controller

    SETUP = '''
    import os, subprocess, sys
    import forkd_engine.agent.shell as shell_module
    def listing(path):
        try:
            return sorted(os.listdir(path))
        except OSError as exc:
            return type(exc).__name__
    '''

    checkout, data_dir = sys.argv[1:]
    ctl = Controller(data_dir)
    out = {}
    try:
        # shell="ipython": the agent imports forkd_engine.agent.shell only inside the sandbox
        ctl.create_snapshot("anywhere", engine="process", shell="ipython", setup=SETUP)
        sb = ctl.spawn("anywhere")[0]["id"]
        ask = lambda expr: ast.literal_eval(ctl.eval(sb, expr)["result"])
        out["host"] = __import__("forkd_engine").__file__
        out["shell"] = ask("shell_module.__file__")
        out["subprocess"] = ask("subprocess.run([sys.executable, '-c', 'import forkd_engine.agent.shell as m; "
                                "print(m.__file__)'], capture_output=True, text=True).stdout.strip()")
        out["data_dir_inside"] = ask(f"listing('/.forkd-code{data_dir}')")
        out["data_dir"] = sorted(os.listdir(data_dir))
    finally:
        for s in ctl.list_sandboxes():
            ctl.kill_sandbox(s["id"])
        for s in ctl.list_snapshots():
            ctl.delete_snapshot(s["tag"])
        ctl.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def checkout():
    """forkd's packages copied under /tmp, as a clone there would hold them."""
    path = tempfile.mkdtemp(prefix="fkco")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "forkd_server", Path(path, "forkd_server"), ignore=ignore)
    shutil.copytree(REPO / "engine" / "forkd_engine", Path(path, "engine", "forkd_engine"), ignore=ignore)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_from(checkout: str, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=checkout, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": f"{checkout}:{checkout}/engine"}, **kwargs)


@requires_root
def test_code_under_tmp_is_imported_inside_the_sandbox(checkout):
    os.chmod(checkout, 0o755)  # as git clone leaves it (mkdtemp makes it 0700)
    data_dir = os.path.join(checkout, ".data")  # the data dir inside the checkout, as /.data is in ours
    try:
        proc = run_from(checkout, "-c", SCRIPT, checkout, data_dir)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        inside = f"/.forkd-code{os.path.realpath(checkout)}/engine/forkd_engine"
        assert out["host"] == f"{checkout}/engine/forkd_engine/__init__.py"  # the copy ran on the host
        assert out["shell"] == f"{inside}/agent/shell.py"
        assert out["subprocess"] == f"{inside}/agent/shell.py"  # PYTHONPATH inside names it too
        assert "registry.sqlite3" in out["data_dir"] and "registry.sqlite3" not in out["data_dir_inside"], out
        assert wait_gone(engine_processes(data_dir)) == set()  # no sandbox left behind
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_code_closed_to_the_sandbox_uid_is_refused_with_the_fix(checkout):
    os.chmod(checkout, 0o700)
    proc = run_from(checkout, "-c", "from forkd_engine.process import rootfs; rootfs.check_python_location()")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("RuntimeError: forkd's code at "), proc.stderr
    assert last.endswith(f"is mode 700, closed to other users (the sandbox's uid); run chmod o+rx {checkout}")
