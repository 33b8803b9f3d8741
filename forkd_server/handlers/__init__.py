"""Thin tornado handlers for forkd's /v1 API: parse, call the controller in a thread, map errors.

One module per service, as jupyter_server keeps them: ``base`` (auth answers, error bodies, the
body check), ``meta`` (health, version, metrics, OpenAPI, events, tree), ``snapshots``,
``sandboxes`` and ``workspaces``. The route table is here.
"""

from __future__ import annotations

from .base import ApiError, ForkdHandler, NotFoundHandler
from .meta import (OPENAPI_PATH, EventsHandler, HealthHandler, MetricsHandler, OpenAPIHandler, TreeHandler,
                   VersionHandler)
from .sandboxes import (BranchHandler, EvalHandler, ExecHandler, FilesHandler, ForkHandler, FreezeHandler,
                        InterruptHandler, InventoryHandler, MemoryHandler, PingHandler, PromoteHandler, RunHandler,
                        SandboxesHandler, SandboxHandler, StoreHandler, WakeHandler)
from .snapshots import (SnapshotCompactHandler, SnapshotHandler, SnapshotInfoHandler, SnapshotPullHandler,
                        SnapshotPushHandler, SnapshotShareHandler, SnapshotsHandler, StoreSnapshotHandler)
from .workspaces import WorkspaceHandler, WorkspaceResumeHandler, WorkspacesHandler, WorkspaceSuspendHandler

__all__ = ["ApiError", "ForkdHandler", "NotFoundHandler", "OPENAPI_PATH", "route_table"]

# --- the route table ----------------------------------------------------------------------------

ID = r"([^/]+)"


def route_table(prefix: str) -> list[tuple[str, type]]:
    """Every route, relative to base_url. ``prefix`` is 'forkd/' in jupyter lab, '' for forkd serve."""
    from ..kernel_handlers import (KernelCheckoutHandler, KernelHandler,  # they build on ForkdHandler, above
                                   KernelLeaveHandler, KernelsHandler, KernelsLeftHandler)
    from ..session_handler import SessionHandler
    # tornado tries the routes in order, a regular expression each (~0.5 us): the calls made most,
    # one per request of a client's work (a sandbox's agent calls, the sandbox itself), come first.
    # Only ``snapshots/pull`` (before ``snapshots/{ID}``) and ``v1/.*`` (last) depend on the order.
    routes = [
        (rf"v1/sandboxes/{ID}/ping", PingHandler),
        (rf"v1/sandboxes/{ID}/exec", ExecHandler),
        (rf"v1/sandboxes/{ID}/eval", EvalHandler),
        (rf"v1/sandboxes/{ID}/run", RunHandler),
        (rf"v1/sandboxes/{ID}", SandboxHandler),
        (r"v1/sandboxes", SandboxesHandler),
        (r"healthz/?", HealthHandler),
        (r"version", VersionHandler),
        (r"metrics", MetricsHandler),
        (r"v1/openapi\.json", OpenAPIHandler),
        (r"v1/events", EventsHandler),
        (r"v1/tree", TreeHandler),
        (r"v1/snapshots", SnapshotsHandler),
        (r"v1/snapshots/pull", SnapshotPullHandler),
        (rf"v1/snapshots/{ID}", SnapshotHandler),
        (rf"v1/snapshots/{ID}/info", SnapshotInfoHandler),
        (rf"v1/snapshots/{ID}/compact", SnapshotCompactHandler),
        (rf"v1/snapshots/{ID}/push", SnapshotPushHandler),
        (rf"v1/snapshots/{ID}/share", SnapshotShareHandler),
        (rf"v1/store/snapshots/{ID}", StoreSnapshotHandler),
        (rf"v1/sandboxes/{ID}/branch", BranchHandler),
        (rf"v1/sandboxes/{ID}/fork", ForkHandler),
        (rf"v1/sandboxes/{ID}/promote", PromoteHandler),
        (rf"v1/sandboxes/{ID}/interrupt", InterruptHandler),
        (rf"v1/sandboxes/{ID}/session", SessionHandler),
        (rf"v1/sandboxes/{ID}/inventory", InventoryHandler),
        (rf"v1/sandboxes/{ID}/memory", MemoryHandler),
        (rf"v1/sandboxes/{ID}/files", FilesHandler),
        (rf"v1/sandboxes/{ID}/freeze", FreezeHandler),
        (rf"v1/sandboxes/{ID}/store", StoreHandler),
        (rf"v1/sandboxes/{ID}/wake", WakeHandler),
        (r"v1/kernels", KernelsHandler),
        (rf"v1/kernels/{ID}", KernelHandler),
        (rf"v1/kernels/{ID}/checkout", KernelCheckoutHandler),
        (rf"v1/kernels/{ID}/leave", KernelLeaveHandler),
        (r"v1/kernels-left", KernelsLeftHandler),
        (r"v1/workspaces", WorkspacesHandler),
        (rf"v1/workspaces/{ID}", WorkspaceHandler),
        (rf"v1/workspaces/{ID}/suspend", WorkspaceSuspendHandler),
        (rf"v1/workspaces/{ID}/resume", WorkspaceResumeHandler),
        (r"v1/.*", NotFoundHandler),
    ]
    return [("/" + prefix + pattern, handler) for pattern, handler in routes]
