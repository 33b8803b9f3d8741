"""Client SDK for forkd's /v1 API, sync and async; importing it never imports jupyter_server.

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
        tries = sb.fork(count=3)          # a fork tree: three copies of sb as it is now
        tries[1].promote()                # keep one; the other two are killed

``AsyncController``, ``AsyncSandbox`` and ``AsyncSnapshot`` are the same for asyncio: the same
methods, arguments, answers and errors, awaited::

    from forkd_server.client import AsyncSnapshot
    snap = await AsyncSnapshot.create("py", setup="import time")
    async with (await snap.fork())[0] as sb:
        async for event in sb.run_stream("print('hi')"):
            ...

Where the server is: ``base_url`` argument, else ``$FORKD_URL``, else (inside a notebook, or on a
host with a running ``forkd serve`` / Jupyter server with forkd enabled) the running server found
from Jupyter's runtime files, else ``http://127.0.0.1:8889``. The token: ``token`` argument, else
``$FORKD_TOKEN``, else the discovered server's. Each controller keeps a pool of connections to the
server alive between calls (``max_connections``).

Behind a fleet's router, a list or tree it merged without some host's part (the host did not answer
in time) comes as a ``Partial``: still a list, with ``missing_hosts`` ({url: why}); what those hosts
hold is not in it, and not gone either (``unanswered(*lists)``: those hosts of any of them).

Import from here (``from forkd_server.client import Controller, Sandbox, ...``): this package is
the SDK's one public surface. Its private modules are its rooms, each importing only those below
it: ``_errors`` and ``_discovery``; ``_core`` (sans-I/O: building requests, reading answers,
errors, retries, event decoding, the effects an operation asks for) and ``_cells`` (running cells
over a session, sans-I/O too); ``_sync`` (http.client, pooled) and ``_async`` (its pool ``_http1``
on asyncio; aiohttp for event streams), the two thin transports with their drivers; ``_controller``
(one method per REST route, written once) and
``_objects`` (``Sandbox``, ``Snapshot`` and their async twins, written once). Streaming sessions
are ``forkd_server.streaming`` (``Controller.session``).
"""

from __future__ import annotations

from ._async import AsyncEventStream
from ._controller import AsyncController, Controller
from ._core import Partial, memory_limit_arg, unanswered
from ._discovery import discover_server
from ._errors import BadServerURL, ControllerError, ForkWarning, ServerTimeout, ServerUnreachable, SessionClosed
from ._objects import AsyncSandbox, AsyncSnapshot, CommandResult, Execution, Sandbox, Snapshot
from ._sync import EventStream

__all__ = ["AsyncController", "AsyncEventStream", "AsyncSandbox", "AsyncSnapshot", "BadServerURL", "CommandResult",
           "Controller", "ControllerError", "EventStream", "Execution", "ForkWarning", "Partial", "Sandbox",
           "ServerTimeout", "ServerUnreachable", "SessionClosed", "Snapshot", "discover_server", "memory_limit_arg",
           "unanswered"]
