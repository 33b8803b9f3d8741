"""Controller errors. Each carries the HTTP status the REST layer answers with."""


class ForkdError(Exception):
    """``fields`` go into the error body beside ``error`` (e.g. ``lost``: what a fork would lose)."""

    status = 500

    def __init__(self, message: str, **fields):
        super().__init__(message)
        self.message = message
        self.fields = fields


class BadRequest(ForkdError):
    status = 400


class NotFound(ForkdError):
    status = 404


class Conflict(ForkdError):
    status = 409


class Busy(ForkdError):
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

