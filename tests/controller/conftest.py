from __future__ import annotations

import shutil
import tempfile

import pytest

from forkd_server.controller import Controller

from ..conftest import cleanup

# A variable and a 50 MiB buffer with its hash: the state every fork must carry.
SETUP = """
import hashlib, random
import numpy
counter = 41
blob = numpy.random.default_rng(7).integers(0, 255, 50 * 2**20, dtype=numpy.uint8)
blob_sha = hashlib.sha256(blob.tobytes()).hexdigest()
open('/tmp/from-setup.txt', 'w').write('setup')
"""


@pytest.fixture(scope="module")
def ctl():
    path = tempfile.mkdtemp(prefix="fkc")
    c = Controller(path)
    yield c
    cleanup(c)
    c.close()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def snap(ctl):
    return ctl.create_snapshot("base", setup=SETUP)["tag"]


def ev(ctl: Controller, sandbox_id: str, code: str) -> str:
    reply = ctl.eval(sandbox_id, code)
    assert reply["exit_code"] == 0, reply
    return reply["result"]


def sh(ctl: Controller, sandbox_id: str, script: str, timeout: float = 30) -> dict:
    return ctl.exec(sandbox_id, ["sh", "-c", script], timeout_secs=timeout)
