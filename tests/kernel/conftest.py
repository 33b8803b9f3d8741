"""A ``forkd serve`` for the forkd kernel's tests; kernels find it through FORKD_URL / FORKD_TOKEN."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
from jupyter_client.manager import start_new_kernel

from ..serving import serving


class ServerForKernels:
    """``forkd serve`` (``tests.serving.serving``), exported to kernels started meanwhile through the
    environment; ``stop()`` restores it and stops the server."""

    def __init__(self):
        self._stack = contextlib.ExitStack()
        self.server = self._stack.enter_context(serving())
        self.url, self.token = self.server.url, self.server.token
        self._stack.enter_context(mock.patch.dict(os.environ, FORKD_URL=self.url, FORKD_TOKEN=self.token))

    def stop(self) -> None:
        self._stack.close()


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
