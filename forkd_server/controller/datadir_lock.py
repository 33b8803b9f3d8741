"""One server per data dir: an ``flock`` on ``<data dir>/server.lock``, held while the server runs.

Two servers on one data dir would share the registry but not their events (each fans out only the
changes it makes), so a live tree in one goes stale with no sign, and both would re-attach to, and
reap, the same sandboxes. The second one therefore refuses to start and says which server owns the
dir. The lock is the kernel's: it goes with the process (a crash or ``kill -9`` never leaves it
held), and the descriptor is close-on-exec, so sandboxes and kernels started by the server do not
inherit it. The file holds the owner's pid and URL, for the refusal's message.
"""

from __future__ import annotations

import fcntl
import json
import os

LOCK_NAME = "server.lock"


class DataDirBusy(Exception):
    """Another live server holds the data dir; the message names it and says what to do."""


class DataDirLock:
    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, data_dir: str) -> "DataDirLock":
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        path = os.path.join(data_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = cls._read(fd)
            os.close(fd)
            where = f" at {owner['url']}" if owner.get("url") else " (still starting)"
            raise DataDirBusy(
                f"the data dir {data_dir} is already served by another forkd server: pid {owner.get('pid', '?')}"
                f"{where}. Use that one (FORKD_URL={owner.get('url') or '...'}; in a notebook the magics find it), "
                f"stop it, or give this server another data dir (forkd serve --data-dir DIR, or "
                f"--ForkdApp.data_dir=DIR / $FORKD_DATA_DIR for jupyter lab)") from None
        lock = cls(path, fd)
        lock.announce(None)
        return lock

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            data = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):  # the owner is writing it this very moment
            return {}

    def announce(self, url: str | None) -> None:
        """Record who holds the lock (its pid, and its URL once it listens)."""
        data = json.dumps({"pid": os.getpid(), "url": url}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1
