"""schemathesis against a real ``forkd serve``: generated requests for every operation of
/v1/openapi.json, checked for server errors and for answers the document does not describe.

The audit's run found 53 mismatches and 5xx; this keeps both at zero. Bounded: a few examples per
operation and a time budget (``FORKD_SCHEMATHESIS_EXAMPLES`` / ``FORKD_SCHEMATHESIS_SECONDS`` raise
them for a deeper run). Left out: /v1/events (a stream that never ends) and the session
WebSocket; the stateful phase is left out too, since chained calls spawn up to 1000 sandboxes each.
The seed is printed on failure (``st run --seed`` replays it).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ..serving import serving

ST = shutil.which("st") or shutil.which("schemathesis")
SEED = os.environ.get("FORKD_SCHEMATHESIS_SEED", "20261124")
CONFIG = os.path.join(os.path.dirname(__file__), "schemathesis.toml")


@pytest.mark.skipif(ST is None, reason="needs schemathesis (pip install schemathesis; the test extra has it)")
# 150 s of requests (one may run past it, up to its 60 s request timeout), then the cleanup of the
# ~1,500 sandboxes the run spawned: under load that passed the suite's 300 s (once in six runs)
@pytest.mark.timeout(600)
def test_schemathesis_finds_no_server_error_and_no_mismatch():
    with serving() as srv:
        url, token = srv.url, srv.token
        done = subprocess.run(
            [ST, "--config-file", CONFIG, "--no-color", "run", f"{url}/v1/openapi.json", "-H", f"Authorization: Bearer {token}",
             "--max-examples", os.environ.get("FORKD_SCHEMATHESIS_EXAMPLES", "5"),
             # the same inputs on every run, so CI is repeatable; FORKD_SCHEMATHESIS_SEED=random explores
             *(["--seed", SEED] if SEED != "random" else []),
             "--max-time", os.environ.get("FORKD_SCHEMATHESIS_SECONDS", "150"),
             "--phases", "examples,coverage,fuzzing", "--workers", "1", "--request-timeout", "60",
             "--exclude-path", "/v1/events", "--exclude-path", "/v1/sandboxes/{id}/session",
             "--output-truncate", "true"],
            capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"})
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-12000:]
        assert "No issues found" in out or "passed" in out, out[-3000:]
