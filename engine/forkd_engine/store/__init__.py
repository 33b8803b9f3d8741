"""The snapshot store: a snapshot's files as content-addressed chunks, a manifest naming them and
what a restore depends on, this host's chunk cache, and remote stores in object storage.

Engine-level: no HTTP, no Jupyter. ``persist`` moves files into this host's ``ChunkCache``;
``push``/``pull`` move a snapshot's chunks between it and a ``RemoteStore``; ``materialise`` writes
the files back from the cache and, for a pull, from a ``RemoteStore`` in the same pass.
"""

from .assemble import materialise
from .cache import ChunkCache
from .chunks import CHUNK_SIZE
from .errors import ChunkCorrupt, Incompatible, NotInStore, StoreError
from .manifest import Manifest, parse_digest
from .remote import RemoteStore
from .transfer import delete, fetch_manifest, persist, pull, push

__all__ = ["CHUNK_SIZE", "ChunkCache", "ChunkCorrupt", "Incompatible", "Manifest", "NotInStore", "RemoteStore",
           "StoreError", "delete", "fetch_manifest", "materialise", "parse_digest", "persist", "pull", "push"]
