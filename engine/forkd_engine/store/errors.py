"""What the store raises: every error names the store (never its secret) and what failed."""

from __future__ import annotations

from ..base import EngineError


class StoreError(EngineError):
    """A store could not be reached, denied access, or failed an operation; the message names the
    store and the operation."""


class NotInStore(StoreError):
    """The store holds no manifest for that digest, or no such tag."""


class ChunkCorrupt(StoreError):
    """A chunk's content does not match its digest: the store was tampered with or damaged. Nothing
    of the snapshot is restored."""

    def __init__(self, store: str, chunk: str, why: str):
        self.chunk = chunk
        super().__init__(f"store {store}: chunk {chunk} failed its check ({why}); the pull stopped and "
                         f"nothing was restored from it. Push the snapshot again from a host that holds it "
                         f"to repair the store")


class Incompatible(EngineError):
    """This host cannot restore the snapshot: one of the manifest's restore dependencies differs.
    ``field`` names it, ``wanted`` is the snapshot's, ``have`` this host's."""

    def __init__(self, what: str, field: str, wanted, have):
        self.field, self.wanted, self.have = field, wanted, have
        super().__init__(f"{what} cannot be restored on this host: its {field} is {wanted!r}, this host's is "
                         f"{have!r} ({WHY.get(field, 'the restore depends on it')})")


WHY = {
    "qemu": "device state is QEMU's own format, not portable across its versions",
    "machine": "device state belongs to one machine type",
    "accel": "a snapshot made under one accelerator does not load under another",
    "cpu": "the guest was started on that CPU model and may use its features",
    "format": "this host's forkd cannot read that manifest format",
}
