"""Tab completion of ``%forkd`` lines: subcommands, their flags, snapshot tags, sandbox ids and the
variables that hold sandboxes.

An IPython completion matcher (API v2, in ``Completer.custom_matchers``) that answers on lines holding
``%forkd`` and then suppresses the others: Jedi would offer every builtin after ``-t tab-``. Tags and
ids come from the server, which may be slow or gone: they are read in a background thread with a
short timeout and cached for a few seconds, and a completion waits at most ``WAIT`` seconds for
them, so a slow server never holds the kernel; it then completes what needs no server.
"""

from __future__ import annotations

import re
import threading
import time

from IPython.core.completer import SimpleCompletion, context_matcher

from forkd_server.client import Controller, Sandbox

from ._args import SANDBOX_ARGS, SUBCOMMANDS, TAG_OPTIONS, options, positional

IDENTIFIER = "forkd_magics"
WAIT = 0.3             # seconds a completion may wait for the server's tags and ids
FRESH = 5.0            # seconds the tags and ids are reused
FETCH_TIMEOUT = 2.0    # seconds the background read may take

# options naming an existing snapshot (a new tag for snapshot and branch is the user's to invent)
_EXISTING_TAG = {"fork", "kill", "run"}


class ForkdCompleter:
    """The completer of one ``ForkdMagics``; ``matcher`` is what IPython's completer calls."""

    def __init__(self, magics):
        self.magics = magics
        self._lock = threading.Lock()
        self._names: tuple[list[str], list[str]] | None = None  # (tags, ids)
        self._read_at = 0.0
        self._reading: threading.Thread | None = None

    # --- the server's names, never waited on for long --------------------------------------------

    def _read(self) -> None:
        try:
            ctl = self.magics.controller
            fast = Controller(ctl.base_url, ctl.token, timeout=FETCH_TIMEOUT)
            names = (sorted(s["tag"] for s in fast.list_snapshots()), sorted(s["id"] for s in fast.list_sandboxes()))
        except Exception:  # noqa: BLE001 - no names this time; the completion goes on without them
            names = None
        with self._lock:
            if names is not None:
                self._names = names
            self._read_at = time.monotonic()
            self._reading = None

    def server_names(self) -> tuple[list[str], list[str]]:
        """(tags, ids): the cached ones, refreshed in the background when older than ``FRESH``."""
        with self._lock:
            stale = time.monotonic() - self._read_at > FRESH
            if stale and self._reading is None:
                self._reading = threading.Thread(target=self._read, name="forkd-complete", daemon=True)
                self._reading.start()
            reading = self._reading
        if reading is not None and (self._names is None or stale):
            reading.join(WAIT)
        with self._lock:
            return self._names or ([], [])

    def forget(self) -> None:
        """Another server: read its names afresh."""
        with self._lock:
            self._names, self._read_at = None, 0.0

    # --- what fits where -------------------------------------------------------------------------

    def _variables(self) -> list[str]:
        ns = self.magics.shell.user_ns if self.magics.shell is not None else {}
        found = []
        for name, value in list(ns.items()):
            if name.startswith("_"):
                continue
            items = value if isinstance(value, (list, tuple)) else [value]
            if items and all(isinstance(v, Sandbox) for v in items):
                found.append(name)
        return sorted(found)

    def completions(self, text_until_cursor: str) -> list[str]:
        at = text_until_cursor.rfind("%forkd")
        if at < 0:
            return []
        words = re.split(r"\s+", text_until_cursor[at + len("%forkd"):].lstrip())
        *before, current = words
        if not before:
            return sorted(SUBCOMMANDS)
        sub = before[0]
        if sub not in SUBCOMMANDS:
            return []
        if current.startswith("-"):
            return options(sub)
        if len(before) > 1 and before[-1] in TAG_OPTIONS:
            return self.server_names()[0] if sub in _EXISTING_TAG else []
        if "--" in before:  # exec's command: the shell's business
            return []
        kind = positional(sub)
        if kind in SANDBOX_ARGS:
            return self._variables() + self.server_names()[1]
        if kind == "tags" or (kind == "tag" and sub == "push"):  # pull's tag is the store's: not listed here
            return self.server_names()[0]
        if kind == "target":
            tags, ids = self.server_names()
            return self._variables() + ids + tags
        return []

    def matcher(self):
        @context_matcher(identifier=IDENTIFIER)
        def forkd_matcher(context) -> dict:
            token = context.token
            found = [c for c in self.completions(context.text_until_cursor) if c.startswith(token)]
            # ours alone, or (nothing of ours here, e.g. exec's command) everyone else's
            return {"completions": [SimpleCompletion(c, type="forkd") for c in found], "suppress": bool(found)}
        forkd_matcher.completer = self
        return forkd_matcher


def install(shell, magics) -> ForkdCompleter:
    """Register (once) the completer of ``magics`` on ``shell``."""
    uninstall(shell)
    completer = ForkdCompleter(magics)
    shell.Completer.custom_matchers.append(completer.matcher())
    return completer


def uninstall(shell) -> None:
    matchers = shell.Completer.custom_matchers
    matchers[:] = [m for m in matchers if getattr(m, "matcher_identifier", None) != IDENTIFIER]
