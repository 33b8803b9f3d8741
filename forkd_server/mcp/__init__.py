"""forkd's MCP server: forkd-mcp's tools, fork trees (fork a sandbox into copies, promote the one that
worked), the notebook's own (fork a live notebook, run cells in the copies, check the pick out), the
tiers (freeze, store and wake a sandbox), the lineage and sandboxes' files as resources.

Carried three ways, all over the client SDK (so the server's auth, limits and errors apply as for
any client): ``forkd mcp`` over stdio (``stdio``), streamable HTTP at ``{base_url}forkd/mcp`` inside
jupyter-server and ``/mcp`` in ``forkd serve`` (``http``), and memory in tests (``build_server``).
Needs the ``mcp`` package, 2.x (``pip install 'forkd-jupyter[mcp]'``); ``SUPPORTED`` says which.
"""

from __future__ import annotations

SUPPORTED = "mcp>=2.3,<3"


def missing_sdk() -> str | None:
    """Why the MCP server cannot run here (the mcp package absent or of another major), or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        found = version("mcp")
    except PackageNotFoundError:
        return f"the mcp package is not installed: pip install 'forkd-jupyter[mcp]' (or '{SUPPORTED}')"
    major = found.split(".")[0]
    if major != "2":
        return f"forkd's MCP server needs {SUPPORTED}; mcp {found} is installed: pip install '{SUPPORTED}'"
    return None


def build_server(controller=None):
    """See ``_server.build_server`` (imported on use, so this package imports without mcp)."""
    from ._server import build_server as build
    return build(controller)
