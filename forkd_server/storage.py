"""A full data dir: recognise it in any failure and say so (507, the path and its free space).

SQLite says "database or disk is full", the engines and agents raise ``OSError(ENOSPC)`` or pass
its text on ("No space left on device"), sometimes wrapped in an engine error. Whatever the layer,
the user's answer is the same: which file system is full and how much is left.
"""

from __future__ import annotations

import errno
import shutil
import sqlite3

from .errors import InsufficientStorage

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("No space left on device", "database or disk is full", "Disk quota exceeded")


def is_disk_full(exc: BaseException | None) -> bool:
    """True if ``exc``, or anything it was raised from, says the disk is full."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        if any(text in str(exc) for text in _FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def full_disk_error(data_dir: str) -> InsufficientStorage:
    try:
        free = shutil.disk_usage(data_dir).free
    except OSError:
        free = None
    shown = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    return InsufficientStorage(
        f"the data dir {data_dir} is full ({shown}): this call did not complete; free space there (delete snapshots "
        f"or sandboxes you no longer need, or other files on that file system) and retry",
        path=data_dir, free_bytes=free)
