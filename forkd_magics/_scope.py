"""Which notebook the magics run in, and so what "this notebook" means for ``ls``, ``kill --all``,
``delete --all`` and ``tree``.

What the magics create carries two labels, the ones the JupyterLab panel's "this notebook" filter
reads (``labextension/src/panel.ts``): ``jupyter.kernel_id`` (the kernel's id, from its connection
file ``kernel-<id>.json``) and ``jupyter.notebook`` (the notebook's path relative to the Jupyter
server's root, from ``$JPY_SESSION_NAME``, which jupyter_server sets for a notebook's kernel). A node
belongs to this notebook when it carries either, or is the HEAD of this kernel (forkd kernel), as in
the panel. The path outlives a kernel restart; the id covers kernels started without one (nbclient).
Outside a kernel (a terminal IPython, a script) there is no notebook: the scope is everything.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from forkd_server.client import ControllerError, Partial, unanswered

NOTEBOOK = "jupyter.notebook"
KERNEL_ID = "jupyter.kernel_id"


def notebook_path() -> str | None:
    """The notebook this kernel runs, relative to its Jupyter server's root (as Lab names files):
    jupyter_server gives the kernel the absolute path in $JPY_SESSION_NAME. The forkd kernel uses it
    too, so both kernels name a notebook alike."""
    path = os.environ.get("JPY_SESSION_NAME") or None
    parent = os.environ.get("JPY_PARENT_PID")
    if not path or not os.path.isabs(path) or not parent:
        return path
    try:
        from jupyter_core.paths import jupyter_runtime_dir
        with open(os.path.join(jupyter_runtime_dir(), f"jpserver-{parent}.json")) as f:
            root = json.load(f).get("root_dir")
    except (OSError, ValueError, ImportError):
        return path
    if root and os.path.commonpath([os.path.abspath(root), path]) == os.path.abspath(root):
        return os.path.relpath(path, root)
    return path


def kernel_id() -> str | None:
    """The running kernel's id (an ipykernel's or the forkd kernel's), from its connection file:
    ``kernel-<id>.json`` (jupyter_server's name), else the file's own name (nbclient's temporary ones);
    None outside a kernel."""
    try:
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return None
    if not IPKernelApp.initialized():
        return None
    name = os.path.basename(getattr(IPKernelApp.instance(), "connection_file", "") or "")
    m = re.match(r"kernel-(.+)\.json$", name)
    return m.group(1) if m else (os.path.splitext(name)[0] or None)


@dataclass(frozen=True)
class Scope:
    """This notebook: its kernel id, its path, and (forkd kernel) the sandbox it runs in."""

    kernel_id: str | None = None
    notebook: str | None = None
    head: str | None = None

    @classmethod
    def current(cls, head: str | None = None) -> "Scope":
        return cls(kernel_id(), notebook_path(), head)

    @property
    def labels(self) -> dict[str, str]:
        """What the magics put on the snapshots and sandboxes they create."""
        return {k: v for k, v in ((KERNEL_ID, self.kernel_id), (NOTEBOOK, self.notebook)) if v}

    @property
    def everything(self) -> bool:
        """No notebook to scope to (a terminal IPython, a script)."""
        return not self.labels

    @property
    def filters(self) -> list[dict[str, str]]:
        """One server-side ``?label=`` filter per label; a node matching any is this notebook's."""
        return [{k: v} for k, v in self.labels.items()]

    def matches(self, labels: dict | None, heads: list[str] | tuple = ()) -> bool:
        """Is a node with these labels (and HEAD of these kernels) this notebook's?"""
        if self.everything:
            return True
        labels = labels or {}
        return (any(labels.get(k) == v for k, v in self.labels.items())
                or (self.kernel_id is not None and self.kernel_id in heads))

    def __str__(self) -> str:
        if self.notebook:
            return f"this notebook ({self.notebook})"
        if self.kernel_id:
            return f"this kernel ({self.kernel_id[:8]})"
        return "everyone"


def _union(lists: list[list[dict]], key: str) -> list[dict]:
    """One list of every item once; a ``Partial`` if a router left hosts out of any of ``lists``."""
    seen: dict[str, dict] = {}
    for items in lists:
        for item in items:
            seen.setdefault(item[key], item)
    missing = unanswered(*lists)
    return Partial(seen.values(), missing) if missing else list(seen.values())


def snapshots_of(controller, scope: Scope | None) -> list[dict]:
    """The snapshots of ``scope`` (None or an empty scope: every snapshot on the server)."""
    if scope is None or scope.everything:
        return controller.list_snapshots()
    return _union([controller.list_snapshots(labels=f) for f in scope.filters], "tag")


def sandboxes_of(controller, scope: Scope | None) -> list[dict]:
    """The running sandboxes of ``scope``, its HEAD included (None or empty: every sandbox)."""
    if scope is None or scope.everything:
        return controller.list_sandboxes()
    found = [controller.list_sandboxes(labels=f) for f in scope.filters]
    if scope.head:
        try:
            found.append([controller.get_sandbox(scope.head)])
        except ControllerError:  # HEAD is gone: the kernel says so on the next cell
            pass
    return _union(found, "id")


def kernel_bases(controller) -> dict[str, list[str]]:
    """The base snapshots the forkd kernels registered with the server fork from (a restart forks a
    fresh HEAD from it): ``{tag: [the notebooks of those kernels]}``; empty on a server without
    ``/v1/kernels``."""
    try:
        kernels = controller.list_kernels()
    except ControllerError:
        return {}
    bases: dict[str, list[str]] = {}
    for k in kernels:
        if k.get("base_snapshot"):
            bases.setdefault(k["base_snapshot"], []).append(k.get("notebook") or f"kernel {k['kernel_id'][:8]}")
    return bases
