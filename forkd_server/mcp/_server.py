"""The MCP server: one ``MCPServer`` over one SDK ``Controller``, whatever carries it (stdio for
``forkd mcp``, streamable HTTP inside jupyter-server and ``forkd serve``, memory in tests)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mcp.server.mcpserver import MCPServer

from .. import __version__
from ..client import Controller
from . import _fork_tree_tools, _forkd_tools, _notebook_tools, _resources, _tier_tools

if TYPE_CHECKING:  # the in-process calls import the server's handlers: never in `forkd mcp`
    from ._in_process import InProcess

INSTRUCTIONS = """\
forkd: fork-on-write Python sandboxes, and notebooks that run in them. A snapshot is a warmed-up
interpreter frozen in time; spawn_sandboxes forks copy-on-write sandboxes from it in milliseconds;
branch_sandbox turns a running sandbox into a new snapshot (a pause of a few ms).
fork_sandbox makes n copies of a running sandbox (one fork tree); promote_sandbox keeps the one that
worked and kills the others.
To try several changes on a user's live notebook: list_notebooks, notebook_fork it (n copies of its
state, one fork tree), run_cell in each copy, notebook_checkout the copy to keep (the user's notebook
moves there), then promote_sandbox it (the other copies go).
A sandbox left idle can be frozen (freeze_sandbox: no CPU) or, on the VM engine, stored
(store_sandbox: no process, no RAM); the next call wakes it, state intact (wake_sandbox: now)."""


def build_server(controller: Controller | None = None, quick: InProcess | None = None) -> MCPServer:
    """The MCP server driving the forkd server ``controller`` reaches (default: the SDK's own
    finding: ``$FORKD_URL``/``$FORKD_TOKEN``, else a running server on this host); ``quick``: that
    server's own calls, when the MCP server lives in it (``_in_process``)."""
    ctl = controller or Controller()
    root = logging.getLogger()
    kept = root.level, list(root.handlers)
    try:
        server = MCPServer("forkd", title="forkd for Jupyter", version=__version__, instructions=INSTRUCTIONS)
    finally:  # its constructor configures the process's root logger (basicConfig): not ours to change
        root.setLevel(kept[0])
        root.handlers[:] = kept[1]
    _forkd_tools.register(server, ctl, quick)
    _fork_tree_tools.register(server, ctl)
    _notebook_tools.register(server, ctl)
    _tier_tools.register(server, ctl)
    _resources.register(server, ctl)
    return server
