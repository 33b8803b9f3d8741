"""forkd-init as PID 1: it exits once its agent ended and the end was collected, however early
the agent asked (an agent that ends before the engine recorded it asks its init at once)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forkd_engine.process import sandbox_init

from ..conftest import requires_root

pytestmark = requires_root

FIRST_PROCESS = """
import sys
from forkd_engine.process import inside
inside.IN_SANDBOX = sys.argv[1]
inside.hand_pid1_to_init()   # PID 1 becomes forkd-init; we go on as its child, the agent
inside.end_unrecorded()      # at once: before the init may even have started
"""


@pytest.mark.parametrize("attempt", range(5))
def test_an_agent_that_ends_at_once_is_collected_and_its_init_exits(attempt):
    init = sandbox_init.build()
    run = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", FIRST_PROCESS, init],
                         timeout=30, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
