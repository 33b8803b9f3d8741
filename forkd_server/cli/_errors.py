"""How the CLI says a failure: one line on stderr and a non-zero status, never a traceback.

The line is ``forkd COMMAND: what happened; what to do``, from the error's ``what`` and ``hint``
and, when its details have one, the fix as a ``forkd`` command. The error may be a
``ControllerError`` from a server, an unreachable server, a ``ForkdError`` of an in-process command
such as ``demo``, a file that cannot be read, or a bad argument (argparse's words, on one line).
``--debug`` (or ``FORKD_DEBUG=1``) adds the error's details, one fact a line, and the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback

UNREACHABLE = 2  # the server is not there (or its URL names none): the command could not even ask
FAILED = 1


def add_debug_option(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """``--debug``, before the command or after it (a command's default leaves the top's alone)."""
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="on an error, also print its details and the traceback (or set FORKD_DEBUG=1)")


def debug_wanted(args: argparse.Namespace | None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("FORKD_DEBUG", "") not in ("", "0")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (the usage is what ``--help`` is for)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _said(exc: BaseException) -> tuple[str, str, dict]:
    """(what, hint, details) of any failure: the errors of forkd say theirs, others their text."""
    what = getattr(exc, "what", None)
    if what is not None:
        return what, getattr(exc, "hint", None) or "", dict(getattr(exc, "details", None) or {})
    if isinstance(exc, OSError) and exc.filename is not None:  # e.g. --setup-file that is not there
        return f"{exc.strerror or exc}: {exc.filename}", "", {}
    if isinstance(exc, (OSError, ValueError)):
        return str(exc), "", {}
    return f"{type(exc).__name__}: {exc}", "run it again with --debug for the traceback", {}


# forkd's own messages, which its wire keeps word for word: what to do about each, in CLI words
LISTED_BY = {"sandbox": "forkd ls lists the sandboxes", "snapshot": "forkd ls --snapshots lists the snapshots",
             "workspace": "forkd workspace list lists the workspaces"}


def _in_cli_words(status: int, what: str, hint: str) -> tuple[str, str]:
    """(what, hint) for a server's bare message: an unknown name says where the names are listed; a
    taken tag says how to free it, rather than REST's 'DELETE first'."""
    if hint:
        return what, hint
    missing = re.fullmatch(r"(sandbox|snapshot|workspace) \S+ not found( on any host of the fleet)?", what)
    if status == 404 and missing:
        return what, f"check the name: {LISTED_BY[missing[1]]}"
    taken = re.fullmatch(r"snapshot (\S+) already exists; DELETE first", what)
    if taken:
        return (f"snapshot {taken[1]} already exists",
                f"choose another tag, or delete that snapshot first: forkd rmi {taken[1]}")
    return what, hint


def item_failed(command: str, key: str, exc) -> None:
    """One item of a bulk command (kill IDS, rmi TAGS) that failed, said on stderr as a failure is:
    ``forkd COMMAND: KEY: what; what to do``."""
    what, hint = _in_cli_words(exc.status, exc.what, exc.hint)
    print(f"forkd {command}: {key}: {what}" + (f"; {hint}" if hint else ""), file=sys.stderr)


def report(command: str, exc: BaseException, *, debug: bool, as_json: bool) -> int:
    """Say ``exc`` as ``forkd COMMAND`` failing; returns the exit status."""
    from ..client import ControllerError, ServerUnreachable
    from ..client._errors import BadServerURL

    what, hint, details = _said(exc)
    if hint and details.get("cli"):  # the fix in this front end's own words
        hint += f": {details['cli']}"
    status = getattr(exc, "status", None) if isinstance(exc, ControllerError) else None
    if status is not None:
        what, hint = _in_cli_words(status, what, hint)
        what += f" (HTTP {status})"
        if status == 401 and not hint:
            hint = "set FORKD_TOKEN (or --token) to the server's token"
        if as_json:  # scripts read the answer on stdout, as they read a success
            print(json.dumps({"status": status, "error": exc.message, **({"details": details} if details else {})}))
    line = f"forkd {command}: {what}" + (f"; {hint}" if hint else "")
    print(" ".join(line.split("\n")), file=sys.stderr)  # one line, whatever the message held
    if debug:
        for key, value in details.items():
            text = value if isinstance(value, str) else json.dumps(value)
            print(f"  {key}: " + "\n    ".join(text.splitlines() or [""]), file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
    return UNREACHABLE if isinstance(exc, (ServerUnreachable, BadServerURL)) else FAILED
