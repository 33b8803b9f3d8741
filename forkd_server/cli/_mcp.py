"""``forkd mcp``: the MCP server over stdio, for Claude Desktop, Jupyter AI or any MCP client that
starts its servers as commands. It drives the server ``--url``/``$FORKD_URL`` names (token
``--token``/``$FORKD_TOKEN``), else the one the SDK finds on this host; stdout carries the protocol
only, anything said goes to stderr."""

from __future__ import annotations

import logging
import os
import sys

from ._errors import add_debug_option
from ._output import client


def cmd_mcp(args) -> int:
    from ..mcp import missing_sdk

    why = missing_sdk()
    if why:
        print(f"forkd mcp: {why}", file=sys.stderr)
        return 2
    from ..mcp import build_server

    ctl = client(args)
    logging.basicConfig(level=logging.WARNING, format="forkd mcp: %(message)s")  # stderr; stdout is the protocol
    print(f"forkd mcp: serving the forkd server at {ctl.base_url} over stdio", file=sys.stderr)
    build_server(ctl).run("stdio")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("mcp", help="the MCP server over stdio (for Claude Desktop, Jupyter AI, any MCP client), "
                                   "driving the server --url names")
    p.add_argument("--url", default=os.environ.get("FORKD_URL"),
                   help="the server (default: $FORKD_URL, a running server found on this host, else "
                        "http://127.0.0.1:8889)")
    p.add_argument("--token", default=None, help="bearer token (default: $FORKD_TOKEN)")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout of each call in seconds (default 60)")
    add_debug_option(p)
    p.set_defaults(func=cmd_mcp)
