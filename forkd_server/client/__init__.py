"""Client SDK for forkd's /v1 API: stdlib only, and importing it never imports jupyter_server.

``Controller`` keeps the PyPI ``forkd`` SDK's method names, arguments and wire bodies
(reference/forkd-api.md §8), so code written for forkd works unchanged; it adds ``create_snapshot``,
``run_code``, files, events and waiting for ``ready``. ``Sandbox`` and ``Snapshot`` give an E2B-like
surface on top::

    from forkd_server.client import Snapshot
    snap = Snapshot.create("py", setup="import numpy as np; data = np.ones(10**6)")
    with snap.fork()[0] as sb:
        sb.run_code("total = data.sum()")
        child_snap = sb.branch(mode="live", wait=False).wait()
        grandkids = child_snap.fork(3)

Where the server is: ``base_url`` argument, else ``$FORKD_URL``, else (inside a notebook, or on a
host with a running ``forkd serve`` / Jupyter server with forkd enabled) the running server found
from Jupyter's runtime files, else ``http://127.0.0.1:8889``. The token: ``token`` argument, else
``$FORKD_TOKEN``, else the discovered server's token.

Import from here (``from forkd_server.client import Controller, Sandbox, ...``): this package is
the SDK's one public surface. Its private modules are its rooms, each importing only those below
it: ``_transport`` (finding the server, one request, errors, the event stream), ``_controller``
(``Controller``: one method per REST route) and ``_objects`` (``Sandbox``, ``Snapshot`` and what
their calls return). Streaming sessions are ``forkd_server.streaming`` (``Controller.session``).
"""

from __future__ import annotations

from ._controller import Controller
from ._objects import CommandResult, Execution, Sandbox, Snapshot
from ._transport import (ControllerError, EventStream, ForkWarning, ServerTimeout, ServerUnreachable,
                         discover_server)

__all__ = ["Controller", "ControllerError", "ServerUnreachable", "ServerTimeout", "ForkWarning", "Sandbox",
           "Snapshot", "CommandResult", "Execution", "EventStream", "discover_server"]
