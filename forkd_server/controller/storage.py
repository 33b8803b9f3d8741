"""A full data dir: recognise it in any failure and say so (507, the path and its free space).

SQLite says "database or disk is full", the engines and agents raise ``OSError(ENOSPC)`` or pass
its text on ("No space left on device"), sometimes wrapped in an engine error. Whatever the layer,
the user's answer is the same: which file system is full and how much is left.
"""

from __future__ import annotations

import errno
import shutil
import sqlite3

from ..errors import InsufficientStorage, StoreFailure

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("No space left on device", "database or disk is full", "Disk quota exceeded")


def _chain(exc: BaseException | None):
    """``exc`` and everything it was raised from, each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException | None) -> bool:
    """True if ``exc``, or anything it was raised from, says the disk is full. A remote store's
    failure is the store's, never this host's, even when it says "No space left on device" (a full
    ``file://`` store): it stays a 502 naming the store."""
    if isinstance(exc, StoreFailure):
        return False
    for exc in _chain(exc):
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        if any(text in str(exc) for text in _FULL_TEXT):
            return True
    return False


def full_path(exc: BaseException | None) -> str | None:
    """The file an ``ENOSPC`` in ``exc``'s chain names (e.g. a VM's RAM tmpfs), if one does."""
    return next((e.filename for e in _chain(exc)
                 if isinstance(e, OSError) and e.errno in _FULL_ERRNOS and isinstance(e.filename, str)), None)


def full_disk_error(data_dir: str, exc: BaseException | None = None) -> InsufficientStorage:
    """507 naming the full file system: the one the failure names (``exc``), else the data dir's."""
    path = full_path(exc) or data_dir
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    shown = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    if path == data_dir:
        said = f"the data dir {data_dir} is full ({shown})"
    else:  # e.g. a VM's RAM tmpfs: what the failed call held there is freed by now
        said = f"{path} (used by the data dir {data_dir}) ran out of space ({shown} now)"
    return InsufficientStorage(
        f"{said}: this call did not complete",
        hint="free space there (delete snapshots or sandboxes you no longer need, or other files) and retry",
        path=path, free_bytes=free)
