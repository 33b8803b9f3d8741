"""Controller errors. Each carries the HTTP status the REST layer answers with.

An error is read by a person: ``what`` happened in one line, ``hint`` (optional) what to do in one
more, and ``details`` the rest (figures, the same fix in REST/SDK/CLI/magic words), which the
notebook shows collapsed and the CLI with ``--debug``. The REST body is ``{"error": message,
"details": {...}, **fields}``: ``message`` is the two lines, so a client that reads only ``error``
still learns both.
"""

from __future__ import annotations


def two_lines(what: str, hint: str | None) -> str:
    """The ``error`` string: what happened, then (on its own line) what to do."""
    return f"{what}\n{hint}" if hint else what


def internal_error(exc: BaseException | None) -> str:
    """The ``error`` of a 500 that is none of ours (a bug): what was raised, as every route says it."""
    return "internal error" if exc is None else f"internal error: {type(exc).__name__}: {exc}"


class ForkdError(Exception):
    """``fields`` go into the error body beside ``error`` (e.g. ``lost``: what a fork would lose);
    ``details`` (when any) go there as ``details``."""

    status = 500

    def __init__(self, what: str, *, hint: str | None = None, details: dict | None = None, **fields):
        self.what, self.hint, self.details = what, hint or None, dict(details or {})
        self.message = two_lines(what, self.hint)
        super().__init__(self.message)
        self.fields = {**fields, **({"details": self.details} if self.details else {})}


class BadRequest(ForkdError):
    status = 400


class NotFound(ForkdError):
    status = 404


class Conflict(ForkdError):
    status = 409


class Busy(ForkdError):
    status = 503


class Recovering(ForkdError):
    """The server restarted and has not settled this object yet (recovery.py): retry shortly."""
    status = 503


class EngineFailure(ForkdError):
    """The engine failed doing valid work (a crash, a timeout); the message names the cause."""
    status = 500


class Gone(ForkdError):
    """The sandbox a call ran or waited in was killed (or its process ended) meanwhile."""
    status = 410


class TooManyRequests(ForkdError):
    status = 429


class InsufficientStorage(ForkdError):
    """The data dir's file system is full; the body names the path and its free space."""
    status = 507


class StoreFailure(ForkdError):
    """A snapshot store failed: unreachable, denying access, or serving a chunk that fails its check.
    The message names the store (never its credentials) and what failed."""
    status = 502
