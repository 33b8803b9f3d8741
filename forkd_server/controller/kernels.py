"""Which sandbox each forkd kernel is on (its HEAD): the lineage panel marks it, a restarted kernel
finds the one it left.

A forkd kernel registers its HEAD whenever it moves (start, checkout) and forgets itself when it
shuts down; a restart keeps the record, so the fresh kernel can say where the old state still is.
A Jupyter server that stops takes its kernels along after forkd stopped answering them: forkd then
``leave``s their records, keeping each notebook's last HEAD, and the notebook's next forkd kernel is
told where it is when it registers (once), so it says so under its first cell instead of starting
silently fresh (a Jupyter server that passes forkd on, remote or router mode, asks for it with
``POST /v1/kernels/{id}/leave``; a kernel whose forget then finds no record keeps its sandboxes).
The records live in the registry's database (tables of their own), so a server
restart keeps them.
"""

from __future__ import annotations

import re
import time
from typing import Callable

from ..errors import BadRequest, NotFound

KERNEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS kernels (
    kernel_id TEXT PRIMARY KEY,
    head TEXT NOT NULL,
    notebook TEXT,
    base_snapshot TEXT,
    engine TEXT,
    updated_at REAL NOT NULL
)"""
FIELDS = ("kernel_id", "head", "notebook", "base_snapshot", "engine", "updated_at")
# a notebook's last HEAD, left by a kernel its Jupyter server stopped (one per notebook, said once)
_LEFT_SCHEMA = """
CREATE TABLE IF NOT EXISTS kernels_left (
    notebook TEXT PRIMARY KEY,
    head TEXT NOT NULL,
    kernel_id TEXT NOT NULL,
    left_at REAL NOT NULL
)"""


def check_kernel_id(kernel_id) -> str:
    if not isinstance(kernel_id, str) or not KERNEL_ID_RE.match(kernel_id):
        raise BadRequest(f"invalid kernel id {kernel_id!r}: 1-128 characters from A-Z a-z 0-9 . _ -")
    return kernel_id


class KernelHeads:
    def __init__(self, registry, emit: Callable[..., None]):
        self.registry = registry
        self._emit = emit
        with registry.tx() as db:
            db.execute(_SCHEMA)
            db.execute(_LEFT_SCHEMA)

    def _rows(self, where: str = "", args: tuple = ()) -> list[dict]:
        with self.registry.tx() as db:
            cursor = db.execute(f"SELECT {', '.join(FIELDS)} FROM kernels {where} ORDER BY updated_at", args)
            return [dict(zip(FIELDS, row)) for row in cursor.fetchall()]

    def list(self) -> list[dict]:
        return self._rows()

    def get(self, kernel_id) -> dict:
        rows = self._rows("WHERE kernel_id=?", (check_kernel_id(kernel_id),))
        if not rows:
            raise NotFound(f"kernel {kernel_id} not found (it never registered, or it shut down)")
        return rows[0]

    def set_head(self, kernel_id, head, *, notebook=None, base_snapshot=None, engine=None) -> dict:
        check_kernel_id(kernel_id)
        for name, value in (("head", head), ("notebook", notebook), ("base_snapshot", base_snapshot),
                            ("engine", engine)):
            if value is not None and (not isinstance(value, str) or len(value) > 4096):
                raise BadRequest(f"{name} must be a string of at most 4096 characters")
        if not head:
            raise BadRequest("head is required: the sandbox id the kernel is on")
        row = {"kernel_id": kernel_id, "head": head, "notebook": notebook, "base_snapshot": base_snapshot,
               "engine": engine, "updated_at": time.time()}
        left = None
        with self.registry.tx() as db:
            db.execute(f"INSERT OR REPLACE INTO kernels ({', '.join(FIELDS)}) VALUES ({', '.join('?' * len(FIELDS))})",
                       tuple(row[f] for f in FIELDS))
            if notebook:  # the notebook's last HEAD before its Jupyter server stopped: told once
                found = db.execute("SELECT head, kernel_id, left_at FROM kernels_left WHERE notebook=?",
                                   (notebook,)).fetchone()
                if found is not None:
                    db.execute("DELETE FROM kernels_left WHERE notebook=?", (notebook,))
                    left = dict(zip(("head", "kernel_id", "left_at"), found))
        self._emit("kernel", "head", kernel_id=kernel_id, head=head, notebook=notebook)
        return {**row, "left": left} if left is not None and left["head"] != head else row

    def leave(self, kernel_id) -> bool:
        """Forget a kernel its Jupyter server stopped, keeping its notebook's HEAD for the notebook's
        next kernel (``set_head`` tells it). False when there is no such record (it forgot itself)."""
        check_kernel_id(kernel_id)
        with self.registry.tx() as db:
            found = db.execute("SELECT head, notebook FROM kernels WHERE kernel_id=?", (kernel_id,)).fetchone()
            if found is None:
                return False
            head, notebook = found
            if notebook:
                db.execute("INSERT OR REPLACE INTO kernels_left (notebook, head, kernel_id, left_at) VALUES (?, ?, ?, ?)",
                           (notebook, head, kernel_id, time.time()))
            db.execute("DELETE FROM kernels WHERE kernel_id=?", (kernel_id,))
        self._emit("kernel", "gone", kernel_id=kernel_id)
        return True

    def take_left(self, notebook, head=None) -> dict | None:
        """Remove and return the notebook's left HEAD (only if it is ``head``, when given): told
        elsewhere, e.g. by a fleet's router to a kernel whose new HEAD is on another host."""
        if not isinstance(notebook, str) or not notebook:
            raise BadRequest("notebook is required: the notebook path whose left HEAD to take")
        with self.registry.tx() as db:
            found = db.execute("SELECT head, kernel_id, left_at FROM kernels_left WHERE notebook=?"
                               + (" AND head=?" if head else ""), (notebook, head) if head else (notebook,)).fetchone()
            if found is not None:
                db.execute("DELETE FROM kernels_left WHERE notebook=?", (notebook,))
        return dict(zip(("head", "kernel_id", "left_at"), found)) if found is not None else None

    def forget(self, kernel_id) -> None:
        check_kernel_id(kernel_id)
        with self.registry.tx() as db:
            gone = db.execute("DELETE FROM kernels WHERE kernel_id=?", (kernel_id,)).rowcount
        if not gone:
            raise NotFound(f"kernel {kernel_id} not found")
        self._emit("kernel", "gone", kernel_id=kernel_id)
