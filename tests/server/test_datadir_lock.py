"""One server per data dir: a second ``forkd serve`` or ``jupyter lab`` on a served data dir refuses to
start and names the server that owns it; a crashed owner (kill -9, sandboxes still running) does not
keep the dir from the next server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from forkd_server.client import Controller

from ..serving import FORKD, Server, free_port, serving


def refused(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0, done.stdout + done.stderr
    return done


def test_a_second_server_on_a_served_data_dir_refuses_and_names_the_owner(short_dir):
    data = os.path.join(short_dir, "d")
    first = Server("--no-token", data_dir=data)
    try:
        first.wait_healthy()
        url = f"http://127.0.0.1:{first.port}"
        owner = f"already served by another forkd server: pid {first.proc.pid} at {url}."
        with open(os.path.join(data, "server.lock")) as f:
            assert json.load(f) == {"pid": first.proc.pid, "url": url}

        second = refused([*FORKD, "serve", "--no-token", "--port", str(free_port()), "--data-dir", data])
        assert owner in second.stdout + second.stderr

        # jupyter lab with the extension, on the same data dir (its default would be ~/.local/share/forkd)
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": os.path.join(short_dir, "rt"), "FORKD_DATA_DIR": data}
        lab = refused([sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={free_port()}",
                       "--ServerApp.port_retries=0", "--ServerApp.jpserver_extensions=forkd_server=True",
                       f"--ServerApp.root_dir={short_dir}"], env=env)
        assert owner in lab.stderr and "FORKD_URL=" + url in lab.stderr

        Controller(url).healthz()  # the owner never noticed
    finally:
        first.stop()


def test_a_crashed_server_leaves_the_data_dir_to_the_next():
    with serving() as server:
        ctl = Controller(server.url, server.token)
        ctl.create_snapshot("lk", setup="x = 1")
        kid = ctl.spawn_sandboxes("lk")[0]  # a process the server started, alive after it dies
        server.crash_and_restart()  # kill -9, then a new server on the same data dir
        assert [s["id"] for s in ctl.list_sandboxes()] == [kid["id"]]
        with open(os.path.join(server.data_dir, "server.lock")) as f:
            assert json.load(f)["pid"] == server.proc.pid
