"""forkd in notebooks: ``%load_ext forkd_magics`` for the ``%forkd`` magics, and the lineage widget.

    %load_ext forkd_magics
    snap = %forkd snapshot -t py --setup "import numpy as np"
    kids = %forkd fork -t py -n 4
    %forkd tree

Everything goes through the client SDK (``forkd_server.client``) and the server's REST API.
"""

from __future__ import annotations

__all__ = ["ForkdMagics", "LineageWidget", "load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str):
    # lazy: importing the package must not pull in anywidget / IPython until they are used
    if name == "LineageWidget":
        from ._widget import LineageWidget
        return LineageWidget
    if name == "ForkdMagics":
        from ._magics import ForkdMagics
        return ForkdMagics
    raise AttributeError(name)


def load_ipython_extension(ipython) -> None:
    """``%load_ext forkd_magics``; loading again replaces the magics (same names) and their tab
    completion, so it is idempotent."""
    from ._complete import install
    from ._magics import ForkdMagics
    magics = ForkdMagics(ipython)
    ipython.register_magics(magics)
    magics.completer = install(ipython, magics)


def unload_ipython_extension(ipython) -> None:
    from ._complete import uninstall
    uninstall(ipython)
    manager = ipython.magics_manager
    for kind in ("line", "cell"):
        manager.magics[kind].pop("forkd", None)
    manager.registry.pop("ForkdMagics", None)
