"""The extension as users get it: a wheel that carries the built extension, installed without node."""

from __future__ import annotations

import re
import shutil
import subprocess
import zipfile

from .conftest import venv_env


def test_wheel_carries_the_built_extension(lab_wheel):
    names = zipfile.ZipFile(lab_wheel).namelist()
    share = "forkd_lab-0.1.0.data/data/share/jupyter/labextensions/forkd-lab/"
    assert any(re.fullmatch(re.escape(share) + r"static/remoteEntry\.[0-9a-f]+\.js", n) for n in names)
    assert share + "install.json" in names and share + "package.json" in names
    assert "forkd_lab/__init__.py" in names
    assert not any("node_modules" in n or n.endswith(".ts") for n in names)


def test_labextension_list_shows_it_enabled_without_node(lab_venv):
    env = venv_env(lab_venv)
    assert shutil.which("node", path=env["PATH"]) is None  # the venv has no node, and nothing else is on PATH
    out = subprocess.run([str(lab_venv / "bin" / "python"), "-m", "jupyterlab.labextensions", "list"],
                         env=env, capture_output=True, text=True, timeout=120)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    assert re.search(r"forkd-lab v0\.1\.0 enabled OK \(python, forkd_lab\)", text), text
    assert str(lab_venv / "share" / "jupyter" / "labextensions") in text
