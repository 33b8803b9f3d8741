"""A ``forkd serve`` for the forkd kernel's tests; kernels find it through FORKD_URL / FORKD_TOKEN."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

import pytest
from jupyter_client.manager import start_new_kernel

from ..serving import Server, cleanup


class ServerForKernels:
    """``forkd serve`` in a subprocess, exported to kernels started meanwhile through the environment."""

    def __init__(self):
        self.workdir = tempfile.mkdtemp(prefix="fk")
        self.token = secrets.token_hex(16)
        with open(os.path.join(self.workdir, "token"), "w") as f:
            f.write(self.token)
        self.server = Server("--token-file", os.path.join(self.workdir, "token"),
                             data_dir=os.path.join(self.workdir, "d"),
                             env={**os.environ, "JUPYTER_RUNTIME_DIR": os.path.join(self.workdir, "rt")})
        self.url = f"http://127.0.0.1:{self.server.port}"
        self._saved = {k: os.environ.get(k) for k in ("FORKD_URL", "FORKD_TOKEN")}
        try:
            self.server.wait_healthy()
        except BaseException:
            self.stop()
            raise
        os.environ.update(FORKD_URL=self.url, FORKD_TOKEN=self.token)

    def stop(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cleanup(self.url, self.token)
        self.server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def forkd_server():
    srv = ServerForKernels()
    yield srv
    srv.stop()


@pytest.fixture
def kernel(forkd_server):
    km, kc = start_new_kernel(kernel_name="forkd-python")
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=False)
