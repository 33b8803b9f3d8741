"""What the CLI shows: tables and spinners for people (rich), JSON for scripts (``--json``)."""

from __future__ import annotations

import contextlib
import json
import sys
import time


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def client(args):
    """The SDK's Controller for ``--url`` / ``--token`` / ``--timeout``."""
    from ..client import Controller

    return Controller(args.url or None, args.token or None, timeout=args.timeout)


def say_unlisted(command: str, *listings, outcome: str = "is not listed") -> None:
    """On stderr, each host a fleet's router left out of ``listings`` (it did not answer in time):
    what it holds ``outcome``, and is not gone either."""
    from ..client import unanswered

    for url, why in unanswered(*listings).items():
        print(f"forkd {command}: host {url} did not answer ({why}); what it holds {outcome}", file=sys.stderr)


def emit_json(obj) -> None:
    print(json.dumps(obj, indent=None if not sys.stdout.isatty() else 2))


def busy(args, what: str):
    """A spinner on stderr while a call runs (none with ``--json``)."""
    return console(stderr=True).status(what, spinner="dots") if not args.json else contextlib.nullcontext()


def ago(ts) -> str:
    if not ts:
        return "-"
    secs = max(0, int(time.time() - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"


def table(title: str, columns: list[str], rows: list[list]):
    from rich.table import Table

    out = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        out.add_column(col, overflow="fold", no_wrap=i == 0)  # ids and tags stay whole
    for row in rows:
        out.add_row(*[("-" if v is None else str(v)) for v in row])
    return out


def progress(total: int, description: str, enabled: bool):
    """A bar on stderr, only where a person watches it: off a terminal a transient bar still leaves
    an empty line, which would come before the one line a failure is said in."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err, transient=True, disable=not (enabled and err.is_terminal))
    return bar, description, total


def labels_arg(pairs: list[str] | None, command: str) -> dict[str, str] | None:
    """``--label k=v`` (repeatable) as a dict; a pair without ``=`` is refused, saying the form."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"forkd {command}: --label takes KEY=VALUE (e.g. --label team=ml), got {pair!r}")
        out[key] = value
    return out or None


def add_label_option(parser, what: str) -> None:
    parser.add_argument("--label", action="append", metavar="KEY=VALUE",
                        help=f"a label {what} (repeatable)")
