"""One REST exchange as it goes on the wire, for tests that look at the status and the body
themselves (where the SDK would raise, or ask again)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def exchange(url: str, method: str = "GET", body: Any = None, headers: dict | None = None,
             timeout: float = 60.0) -> tuple[int, Any]:
    """(status, the body parsed as JSON: None when empty, its text when it is not JSON). An error
    status is returned, not raised."""
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")
