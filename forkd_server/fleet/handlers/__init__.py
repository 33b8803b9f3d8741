"""The router's ``/v1``: the same routes as ``forkd serve``, each answered by the host that holds
its object (pinned calls, passed on as they stream), by placement (spawn, create, pull) or by all
hosts at once (lists, the tree, events), with a ``host`` on everything listed.

Wire rules are forkd serve's: ``{"error": ...}`` bodies, 401 ``missing bearer token`` /
``invalid bearer token`` before anything else, ``/healthz`` without a token. A host's answer is
passed on unchanged (status, body), so its errors reach the client word for word.

One module per service, as the server's handlers are: ``base`` (the token check, error bodies,
passing a request on), ``meta`` (health, version, hosts, metrics, OpenAPI, events, the tree), ``register`` (hosts announcing
themselves),
``snapshots``, ``sandboxes`` and ``workspaces`` (with forkd kernels). The route table is here.
"""

from __future__ import annotations

from ..router import Refusal
from .base import MISSING_HEADER, RouterHandler, check_token, host_query
from .meta import (EventsHandler, HealthHandler, HostsHandler, MetricsHandler, OpenAPIHandler, TreeHandler,
                   VersionHandler)
from .register import RegisterHandler
from .sandboxes import (BranchHandler, ForkHandler, PinnedHandler, PromoteHandler, SandboxesHandler,
                        SandboxHandler)
from .snapshots import (SnapshotCompactHandler, SnapshotHandler, SnapshotInfoHandler, SnapshotPullHandler,
                        SnapshotPushHandler, SnapshotShareHandler, SnapshotsHandler, StoreSnapshotHandler)
from .workspaces import (KernelHandler, KernelLeaveHandler, KernelsHandler, KernelsLeftHandler, WorkspaceHandler,
                         WorkspacesHandler)

__all__ = ["MISSING_HEADER", "RouterHandler", "check_token", "host_query", "route_table"]


class NotFoundHandler(RouterHandler):
    for_users = True  # an unknown route is 404 to everyone

    def _missing(self, *args) -> None:
        raise Refusal(404, f"not found: {self.request.path} is not a route of forkd's /v1")

    get = post = put = patch = delete = _missing


ID = r"([^/]+)"


def route_table() -> list[tuple[str, type]]:
    from ..session import SessionProxy

    return [
        (r"/healthz/?", HealthHandler),
        (r"/version", VersionHandler),
        (r"/metrics", MetricsHandler),
        (r"/v1/openapi\.json", OpenAPIHandler),
        (r"/v1/fleet/hosts", HostsHandler),
        (r"/v1/fleet/register", RegisterHandler),
        (r"/v1/events", EventsHandler),
        (r"/v1/tree", TreeHandler),
        (r"/v1/snapshots", SnapshotsHandler),
        (r"/v1/snapshots/pull", SnapshotPullHandler),
        (rf"/v1/snapshots/{ID}", SnapshotHandler),
        (rf"/v1/snapshots/{ID}/info", SnapshotInfoHandler),
        (rf"/v1/snapshots/{ID}/compact", SnapshotCompactHandler),
        (rf"/v1/snapshots/{ID}/push", SnapshotPushHandler),
        (rf"/v1/snapshots/{ID}/share", SnapshotShareHandler),
        (rf"/v1/store/snapshots/{ID}", StoreSnapshotHandler),
        (r"/v1/sandboxes", SandboxesHandler),
        (rf"/v1/sandboxes/{ID}", SandboxHandler),
        (rf"/v1/sandboxes/{ID}/branch", BranchHandler),
        (rf"/v1/sandboxes/{ID}/fork", ForkHandler),
        (rf"/v1/sandboxes/{ID}/promote", PromoteHandler),
        (rf"/v1/sandboxes/{ID}/session", SessionProxy),
        (rf"/v1/sandboxes/{ID}/(ping|exec|eval|run|interrupt|inventory|memory|files|freeze|store|wake)",
         PinnedHandler),
        (r"/v1/kernels", KernelsHandler),
        (rf"/v1/kernels/{ID}", KernelHandler),
        (rf"/v1/kernels/{ID}/checkout", KernelHandler),
        (rf"/v1/kernels/{ID}/leave", KernelLeaveHandler),
        (r"/v1/kernels-left", KernelsLeftHandler),
        (r"/v1/workspaces", WorkspacesHandler),
        (rf"/v1/workspaces/{ID}", WorkspaceHandler),
        (rf"/v1/workspaces/{ID}/(suspend|resume)", WorkspaceHandler),
        (r"/.*", NotFoundHandler),
    ]
