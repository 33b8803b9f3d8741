"""The controller and its managers: one host's snapshots, sandboxes, branches, workspaces, fork
trees, tiers and stores, kept in its registry. No HTTP and no Jupyter here (the handlers, the
extension and ``forkd serve`` sit above it); the engine below it knows nothing of them.

``controller.py`` holds the ``Controller`` the rest of forkd calls; each other module is one room of
its work (``creation``, ``sandboxes``, ``branching``, ``workspaces``, ``forktrees``, ``tiers``,
``stores``, ``recovery``...) or what the rooms share (``registry``, ``wire``, ``checks``).
"""

from __future__ import annotations

__all__ = ["Controller", "default_data_dir"]


def __getattr__(name: str):
    # Imported on first use, so a light room (the kernel's `checks`, a test's `registry`) does not
    # import every manager and the engine with it.
    if name in __all__:
        from . import controller

        return getattr(controller, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
