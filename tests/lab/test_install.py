"""One install, as users get it: forkd-jupyter's wheel carries the server extension, the kernel, the
magics, the panel (built: no node needed) and ``forkd``; pip install of it into an empty venv, with
no node on PATH, gives JupyterLab with all of them. The panel and the kernel at work in that Lab:
test_panel.py and test_kernel_in_lab.py."""

from __future__ import annotations

import email
import json
import re
import shutil
import subprocess
import zipfile

from forkd_server import __version__

from .conftest import venv_env


def test_wheel_carries_the_whole_jupyter_experience(lab_wheel):
    wheel = zipfile.ZipFile(lab_wheel)
    names = set(wheel.namelist())
    data = f"forkd_jupyter-{__version__}.data/data/"
    panel = data + "share/jupyter/labextensions/forkd-lab/"
    assert any(re.fullmatch(re.escape(panel) + r"static/remoteEntry\.[0-9a-f]+\.js", n) for n in names)
    assert {panel + "install.json", panel + "package.json"} <= names
    assert json.loads(wheel.read(panel + "install.json"))["packageName"] == "forkd-jupyter"
    assert json.loads(wheel.read(panel + "package.json"))["version"] == __version__
    assert data + "share/jupyter/kernels/forkd-python/kernel.json" in names
    assert data + "etc/jupyter/jupyter_server_config.d/forkd_server.json" in names
    assert {f"{p}/__init__.py" for p in ("forkd_server", "forkd_engine", "forkd_magics", "forkd_kernel")} <= names
    assert "forkd_magics/lineage.js" in names  # the widget's drawing
    assert not any("node_modules" in n or n.startswith(("labextension/", "tests/")) for n in names)  # sources stay out
    info = f"forkd_jupyter-{__version__}.dist-info/"
    assert "forkd = forkd_server.cli:main" in wheel.read(info + "entry_points.txt").decode()
    meta = email.message_from_bytes(wheel.read(info + "METADATA"))
    required = {re.split(r"[<>=; \[]", r)[0].lower() for r in meta.get_all("Requires-Dist") if "extra ==" not in r}
    assert {"jupyterlab", "jupyter-server", "ipykernel", "ipython", "ipywidgets", "anywidget"} <= required
    assert {"demo", "test", "bench"} <= set(meta.get_all("Provides-Extra"))


def test_pip_install_of_the_wheel_gives_jupyter_lab_with_forkd_and_no_node(lab_venv):
    env = venv_env(lab_venv, PATH=str(lab_venv / "bin"))  # as the wheel was installed: the venv alone
    assert shutil.which("node", path=env["PATH"]) is None

    def run(*argv) -> str:
        out = subprocess.run([str(lab_venv / "bin" / argv[0]), *argv[1:]], env=env, cwd=lab_venv,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)

    assert re.fullmatch(r"4\.\d+\.\d+\S*\n", run("jupyter", "lab", "--version"))
    listed = run("jupyter", "labextension", "list")
    assert re.search(rf"forkd-lab v{re.escape(__version__)} enabled OK \(python, forkd-jupyter\)", listed), listed
    assert str(lab_venv / "share" / "jupyter" / "labextensions") in listed
    specs = json.loads(run("jupyter", "kernelspec", "list", "--json"))["kernelspecs"]
    assert specs["forkd-python"]["resource_dir"] == str(lab_venv / "share" / "jupyter" / "kernels" / "forkd-python")
    assert specs["forkd-python"]["spec"]["display_name"] == "Python 3 (forkd)"
    assert re.search(r"forkd_server \S+ OK", run("jupyter", "server", "extension", "list"))
    assert "snapshot" in run("forkd", "--help")
    where = run("python", "-c", "import forkd_magics, forkd_kernel, forkd_server; print(forkd_server.__file__)")
    assert where.strip().startswith(str(lab_venv / "lib"))  # the wheel's, not this checkout's
