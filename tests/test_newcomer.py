"""README command 1 as a newcomer types it: in a fresh clone of this repository's committed HEAD
(under /tmp: a checkout anywhere works) and an empty venv (outside /tmp: the engine needs the
interpreter at its own path), the command exactly as the README writes it; then what the README's
notebook section needs is there, from that same install: JupyterLab, the forkd-python kernel and
the forkd-lab panel. A change that breaks a fresh machine fails here instead of for the user."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from .conftest import requires_root
from .lab.conftest import REPO

VENV = REPO / "build" / "newcomer-venv"


def readme_command_1() -> str:
    for line in (REPO / "README.md").read_text().splitlines():
        if re.search(r"#\s*1\.", line):
            return line.split("#")[0].strip()
    raise AssertionError("README.md has no command marked '# 1.'")


@pytest.fixture
def fresh_clone(tmp_path):
    """A git clone of the committed HEAD (uncommitted changes are not what a newcomer gets)."""
    if shutil.which("git") is None:
        pytest.skip("needs git (scripts/setup.sh test installs it)")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    clone = tmp_path / "forkd"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(clone)], check=True, timeout=120)
    subprocess.run(["git", "checkout", "-q", "--detach", head], cwd=clone, check=True, timeout=120)
    yield clone
    shutil.rmtree(clone, ignore_errors=True)


@requires_root
@pytest.mark.slow  # minutes: with -n it starts first
@pytest.mark.timeout(1200)  # a pip install into an empty venv and the panel's build: minutes on a busy host
def test_readme_command_1_in_a_fresh_clone_and_an_empty_venv(fresh_clone):
    command = readme_command_1()
    assert command.startswith("scripts/setup.sh demo"), command
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run(["python3", "-m", "venv", str(VENV)], check=True, timeout=120)
    # the newcomer's shell: this machine's environment, none of this checkout's or this venv's
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("FORKD_")}
    try:
        done = subprocess.run(["bash", "-c", f". {VENV}/bin/activate && {command}"], cwd=fresh_clone, env=env,
                              capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "cleaned up" in done.stdout  # forkd demo ran to its end, its checks held (else exit 1);
        # that it leaves no sandbox behind is test_demo's check

        def run(*argv) -> str:
            out = subprocess.run([str(VENV / "bin" / argv[0]), *argv[1:]], env=env, cwd=VENV, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
            return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)

        assert re.fullmatch(r"4\.\d+\.\d+\S*\n", run("jupyter", "lab", "--version"))
        specs = json.loads(run("jupyter", "kernelspec", "list", "--json"))["kernelspecs"]
        assert specs["forkd-python"]["resource_dir"] == str(VENV / "share" / "jupyter" / "kernels" / "forkd-python")
        assert re.search(r"forkd-lab v\S+ enabled OK \(python, forkd-jupyter\)", run("jupyter", "labextension", "list"))
        where = run("python", "-c", "import forkd_magics, forkd_server; print(forkd_server.__file__)")
        assert where.strip() == str(fresh_clone / "forkd_server" / "__init__.py")  # the clone, installed editable
    finally:
        shutil.rmtree(VENV, ignore_errors=True)


def setup_sh(python_dir, *args) -> subprocess.CompletedProcess:
    """scripts/setup.sh with the python3 of ``python_dir`` first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{python_dir}:{env['PATH']}"
    return subprocess.run([str(REPO / "scripts" / "setup.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_setup_refuses_a_venv_under_tmp_in_one_line(tmp_path):
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    done = setup_sh(tmp_path / "venv" / "bin", "demo")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"forkd setup: the Python environment {tmp_path}/venv lies under /tmp, which every sandbox "
                           f"replaces with its own; make it elsewhere: python3 -m venv ~/forkd-venv && . "
                           f"~/forkd-venv/bin/activate (the checkout itself may stay under /tmp)\n")


def test_setup_refuses_the_systems_python_in_one_line(tmp_path):
    marker = subprocess.run(["/usr/bin/python3", "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                            capture_output=True, text=True).stdout.strip() + "/EXTERNALLY-MANAGED"
    if not os.path.exists(marker):
        pytest.skip("this host's /usr/bin/python3 is not marked externally managed")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").symlink_to("/usr/bin/python3")
    done = setup_sh(tmp_path / "bin")
    assert done.returncode == 1
    assert done.stderr == (f"forkd setup: {tmp_path}/bin/python3 is the system's Python, which pip does not install "
                           f"into; make a virtual environment first: python3 -m venv ~/forkd-venv && . "
                           f"~/forkd-venv/bin/activate\n")


def test_setup_says_its_usage():
    done = subprocess.run([str(REPO / "scripts" / "setup.sh"), "demos"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "usage: scripts/setup.sh [demo|test]\n")
