"""The snapshot store: a snapshot's files as content-addressed chunks, a manifest naming them and
what a restore depends on, this host's chunk cache, and remote stores in object storage.

Engine-level: no HTTP, no Jupyter. ``persist``/``materialise`` move files into and out of this
host's ``ChunkCache``; ``push``/``pull`` move a snapshot between it and a ``RemoteStore``.
"""

from .cache import ChunkCache
from .chunks import CHUNK_SIZE
from .errors import ChunkCorrupt, Incompatible, NotInStore, StoreError
from .manifest import Manifest, parse_digest
from .remote import RemoteStore
from .transfer import delete, fetch_manifest, materialise, persist, pull, push

__all__ = ["CHUNK_SIZE", "ChunkCache", "ChunkCorrupt", "Incompatible", "Manifest", "NotInStore", "RemoteStore",
           "StoreError", "delete", "fetch_manifest", "materialise", "parse_digest", "persist", "pull", "push"]
