"""Finding a running forkd server from Jupyter's runtime files (``jpserver-<pid>.json``)."""

from __future__ import annotations

import glob
import json
import os
import urllib.request

__all__ = ["discover_server"]


def _runtime_dir() -> str:
    if os.environ.get("JUPYTER_RUNTIME_DIR"):
        return os.environ["JUPYTER_RUNTIME_DIR"]
    try:  # jupyter_core knows every platform's default; it is light and does not pull in the server
        from jupyter_core.paths import jupyter_runtime_dir
        return jupyter_runtime_dir()
    except ImportError:
        base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
        return os.path.join(base, "jupyter", "runtime")


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def _probe(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=timeout) as r:  # noqa: S310 - loopback URL
            return json.loads(r.read() or b"{}").get("ok") is True
    except (OSError, ValueError):
        return False


def discover_server() -> tuple[str, str | None] | None:
    """Find a running server with forkd: ``(url, token)`` or None.

    Reads Jupyter's runtime files (``jpserver-<pid>.json``; ``forkd serve`` writes one too). The
    server that started this kernel (``JPY_PARENT_PID``) comes first. Each candidate must answer
    ``/healthz`` under its forkd prefix: ``<url>forkd`` inside jupyter lab, ``<url>`` for ``forkd serve``.
    """
    infos = []
    for path in glob.glob(os.path.join(_runtime_dir(), "jpserver-*.json")):
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        if info.get("url") and _pid_alive(info.get("pid")):
            info["_mtime"] = os.path.getmtime(path)
            infos.append(info)
    parent = os.environ.get("JPY_PARENT_PID")
    infos.sort(key=lambda i: (str(i.get("pid")) != parent, -i["_mtime"]))
    for info in infos[:8]:
        root = info["url"].rstrip("/")
        for url in (root + "/forkd", root):
            if _probe(url):
                return url, info.get("token") or None
    return None
