"""The ``forkd`` command line.

Every subcommand except ``serve``, ``doctor``, ``demo`` and ``image`` talks to a server (``--url``
/ ``$FORKD_URL``, token ``--token`` / ``$FORKD_TOKEN``) through the client SDK; tables and progress
bars for people, ``--json`` for scripts. The commands live beside the REST routes they use, one
module each: ``_snapshots``, ``_store`` (push, pull), ``_sandboxes``, ``_tiers`` (freeze, store, wake), ``_workspaces``, ``_host``
for the commands about this host and ``_mcp`` for the MCP server over stdio; ``_output`` is how
they show what they got, ``_errors`` how they say a failure (one line;
``--debug`` or ``FORKD_DEBUG=1`` adds its details and the traceback). Here: the parser and ``main``.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import _host, _mcp, _sandboxes, _snapshots, _store, _tiers, _workspaces
from ._errors import Parser, add_debug_option, debug_wanted, report

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="forkd", description="Fork-on-write Python sandboxes.")
    add_debug_option(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    options = argparse.ArgumentParser(add_help=False)  # what every command that talks to a server takes
    options.add_argument("--url", "--daemon-url", dest="url", default=os.environ.get("FORKD_URL"),
                         help="the server (default: $FORKD_URL, a running server found on this host, "
                              "else http://127.0.0.1:8889)")
    options.add_argument("--token", "--daemon-token", dest="token", default=None,
                         help="bearer token (default: $FORKD_TOKEN)")
    options.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout in seconds (default 60)")
    options.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    add_debug_option(options)

    _host.add_serve_command(sub)
    _host.add_router_command(sub)
    _snapshots.add_commands(sub, options)
    _store.add_commands(sub, options)
    _sandboxes.add_commands(sub, options)
    _tiers.add_commands(sub, options)
    _workspaces.add_commands(sub, options)
    _host.add_commands(sub, options)
    _mcp.add_commands(sub)
    return parser


def _name(args: argparse.Namespace) -> str:
    """The command as typed: ``workspace suspend``, ``image build``, ``ls``..."""
    return " ".join(filter(None, (args.command, getattr(args, "workspace_command", None),
                                  getattr(args, "image_command", None))))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "serve" or not all(a.startswith(("--ServerApp.", "--ForkdApp.", "--IdentityProvider."))
                                               for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.jupyter_args = extra
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # a command's own refusal of its arguments: status 2, as argparse's
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - every failure is one line (report); --debug adds the traceback
        return report(_name(args), exc, debug=debug_wanted(args), as_json=bool(getattr(args, "json", False)))
