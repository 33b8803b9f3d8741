"""The jupyter-server extension: one ``ForkdApp`` serves ``jupyter lab`` and ``forkd serve``.

Inside ``jupyter lab`` / ``jupyter server`` the routes live under ``{base_url}forkd/``; ``forkd serve``
runs a standalone server with only this extension and ``route_prefix = ""``, so the routes sit at
the root like forkd's daemon. The app owns the controller, the admission of its (blocking) calls
(admission.py: a pool for control calls, another for long ones, and their limits), the Prometheus
registry and the event fan-out (SSE subscribers and jupyter_server's event bus).

With ``remote_url`` (by default ``$FORKD_URL``) it runs no controller: its routes pass every call on
to that server, and that server's events reach the event bus (remote.py). With ``router_hosts`` (or
``router_hosts_dns``, or ``router_register_token_file``) it runs none either: its routes are a
fleet's router, placing sandboxes on those hosts (fleet/extension.py). The three modes exclude each
other.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from jupyter_server.extension.application import ExtensionApp
from prometheus_client import CollectorRegistry, Gauge, Histogram
from traitlets import Bool, Float, Int, List, Unicode, default, validate

from . import __version__, startup
from .controller import default_data_dir

EVENT_SCHEMA_ID = "https://events.jupyter.org/forkd/change/v1"
EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "change" / "v1.yaml"


def default_token(environ=os.environ) -> str:
    """The remote's token as the SDK finds it (``$FORKD_TOKEN``), else, in a JupyterHub user server,
    the server's own Hub token (``$JUPYTERHUB_API_TOKEN``), which the forkd service accepts. Here,
    not in remote.py: jupyter-server reads every trait's default at start-up, and remote.py's
    aiohttp costs ~0.4 s to import, which a server that runs forkd itself never needs."""
    return environ.get("FORKD_TOKEN") or environ.get("JUPYTERHUB_API_TOKEN") or ""


class Metrics:
    """The /metrics families, on a registry of their own (never prometheus_client's global one)."""

    def __init__(self, app: "ForkdApp"):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge("forkd_snapshots_total", "Registered snapshots", registry=r).set_function(
            lambda: len(app.controller.registry.list_snapshots()))
        Gauge("forkd_sandboxes_active", "Running sandboxes", registry=r).set_function(
            lambda: len(app.controller.list_sandboxes()))
        Gauge("forkd_branches_in_flight", "Branches holding a concurrency slot", registry=r).set_function(
            lambda: app.controller.branches.slots_in_use)
        Gauge("forkd_branch_concurrency_cap", "Branch concurrency cap", registry=r).set_function(
            lambda: app.controller.branch_cap)
        Gauge("forkd_build_info", "Build information (always 1)", ["version"], registry=r).labels(
            version=__version__).set(1)
        self.branch_pause = Histogram(
            "forkd_branch_pause_seconds", "How long a branch paused its source sandbox", registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.spawn_latency = Histogram(
            "forkd_spawn_seconds", "Latency of one spawn request (all n children running)", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


class EventHub:
    """Fans controller events out to SSE subscribers and jupyter_server's event bus, on the loop."""

    def __init__(self, app: "ForkdApp"):
        self.app = app
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queues: set[asyncio.Queue] = set()
        self.seq = 0

    def from_thread(self, event: dict) -> None:
        """Controller listener: called in whatever thread made the change."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self.publish, event)
        except RuntimeError:  # the loop is shutting down
            pass

    def publish(self, event: dict) -> None:
        self.seq += 1
        event = {"seq": self.seq, **event}
        for q in list(self.queues):
            q.put_nowait(event)
        logger = getattr(self.app.serverapp, "event_logger", None)
        if logger is not None:
            data = {k: v for k, v in event.items() if v is not None}
            try:
                logger.emit(schema_id=EVENT_SCHEMA_ID, data=data)
            except Exception as exc:  # noqa: BLE001 - a bad event must not break the request
                self.app.log.warning("forkd: could not emit event %r: %s", data, exc)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.queues.discard(q)

    def close(self) -> None:
        for q in list(self.queues):
            q.put_nowait(None)


class ForkdApp(ExtensionApp):
    name = "forkd"
    description = "Fork-on-write Python sandboxes: forkd's /v1 REST API inside jupyter-server."
    extension_url = "/forkd/healthz"
    load_other_extensions = True

    data_dir = Unicode(config=True, help="Where snapshots, sandboxes and the registry live "
                                         "(default: $FORKD_DATA_DIR or ~/.local/share/forkd).")
    branch_concurrency = Int(4, config=True, help="Branches that may be in flight at once (forkd's cap).")
    route_prefix = Unicode("forkd/", config=True, help="Prefix of every route under base_url: "
                                                       "'forkd/' inside jupyter lab, '' for `forkd serve`.")
    max_long_calls = Int(128, config=True, help="Long calls (exec, eval, run, files, branch, spawn, snapshot "
                                                "create...) admitted at once, each with a thread; 503 past it.")
    max_long_calls_per_caller = Int(64, config=True, help="Long calls one caller (one token, or one logged-in "
                                                          "user) may hold at once; 429 past it.")
    control_workers = Int(64, config=True, help="Threads for control calls (list, get, kill, ping, interrupt, "
                                                "tree, metrics...), never shared with long calls. Under more "
                                                "clients than threads, control calls queue for them "
                                                "(bench/RESULTS.md, 'Many clients').")
    sandbox_queue_size = Int(8, config=True, help="Calls (exec, eval, run) that may wait while one runs in the "
                                                  "same sandbox; 409 busy past it.")
    sandbox_queue_timeout = Float(60.0, config=True, help="Seconds a call waits for its sandbox before it is "
                                                          "answered 409 busy.")
    max_sandboxes = Int(None, allow_none=True, config=True,
                        help="The most sandboxes this host holds at once (a fleet's router reads it from /healthz); a "
                             "spawn, fork or workspace that would pass it is refused whole with 503. None: no cap.")
    register = Unicode("", config=True, help="A fleet router's URL this host registers itself with (announcing "
                                             "advertise_url as often as the router says); '' none.")
    register_token_file = Unicode("", config=True, help="File holding the token registrations carry (the router's "
                                                        "--register-token-file).")
    advertise_url = Unicode("", config=True, help="The URL the router reaches this host at (http(s)://HOST:PORT).")
    default_engine = Unicode("auto", config=True, help="Engine for snapshots that do not name one.")
    store = Unicode("", config=True, help="Remote snapshot store for push and pull: s3://bucket/prefix, "
                                          "gs://bucket/prefix, az://container/prefix or file:///path ('' none). "
                                          "S3 settings and credentials come from AWS_ENDPOINT_URL, AWS_REGION, "
                                          "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP.")
    store_endpoint = Unicode("", config=True, help="S3-compatible endpoint of the store (default: $AWS_ENDPOINT_URL).")
    store_region = Unicode("", config=True, help="S3 region of the store (default: $AWS_REGION).")
    store_timeout = Float(120.0, config=True, help="Seconds each request to the store (one 4 MiB chunk, a manifest, "
                                                   "a tag) has to finish before it fails (retried 3 times within 20 "
                                                   "s) and the push or pull fails with 502 saying so.")
    sse_keepalive = Int(15, config=True, help="Seconds between SSE keep-alive comments on /v1/events.")
    max_sessions = Int(256, config=True, help="Streaming sessions (kernels, streamed cells) open at once.")
    recovery_probe_timeout = Float(5.0, config=True, help="Seconds each sandbox and template recorded by the "
                                                          "previous server has to answer its ping after a restart "
                                                          "(calls about it answer 503 until it has, or is ended).")
    allow_host_network = Bool(False, config=True, help="Let callers create snapshots with host_network: their "
                                                       "sandboxes share the host's network, so they reach every "
                                                       "service on its loopback, this server's own port included. "
                                                       "Off: such a request is answered 403.")
    remote_url = Unicode(config=True, help="Another forkd this extension passes every call on to instead of running "
                                           "sandboxes here (a fleet's router, a remote `forkd serve`, the "
                                           "JupyterHub service), so the Lab panel shows what the kernels and magics "
                                           "use (remote.py). Default: $FORKD_URL where the server starts; '' runs "
                                           "forkd here. `forkd serve` never forwards.")
    remote_token = Unicode(config=True, help="The token calls to remote_url carry (never sent to the browser). "
                                             "Default: $FORKD_TOKEN, else $JUPYTERHUB_API_TOKEN (a JupyterHub user "
                                             "server's own).")
    router_hosts = List(Unicode(), config=True,
                        help="Router mode: the `forkd serve` hosts (http(s)://HOST:PORT each) this server's routes "
                             "place sandboxes on, as `forkd router --hosts` does; no sandboxes run here "
                             "(fleet/extension.py). Not with remote_url, nor the options of a server that runs "
                             "sandboxes itself. [] (default): not a router.")
    router_hosts_dns = Unicode("", config=True,
                               help="Router mode, instead of router_hosts: every address this URL's name resolves to, "
                                    "with its scheme and port, resolved again on every heartbeat (forkd router "
                                    "--hosts-dns; a Kubernetes headless Service: http://NAME:PORT).")
    router_hosts_token_file = Unicode("", config=True, help="Router mode: file holding the token the hosts were "
                                                            "started with (forkd router --hosts-token-file).")
    router_register_token_file = Unicode("", config=True,
                                         help="Router mode: let hosts register themselves (forkd serve --register "
                                              "{this server's URL}/forkd --register-token-file F) with the token in "
                                              "this file; alone or beside router_hosts / router_hosts_dns (forkd "
                                              "router --register-token-file).")
    router_hosts_ca = Unicode("", config=True, help="Router mode: CA certificate file to check https hosts with "
                                                    "(default: the system's CAs).")
    router_heartbeat = Float(2.0, config=True, help="Router mode: seconds between two reads of a host's /healthz.")
    router_down_after = Float(10.0, config=True, help="Router mode: seconds without a good /healthz before a host is "
                                                      "down (its sandboxes listed lost).")
    router_host_timeout = Float(5.0, config=True, help="Router mode: seconds a host has to answer the router's own "
                                                       "reads (heartbeat, lists, lookups).")
    router_placement_wait = Float(1.0, config=True, help="Router mode: seconds a spawn waits for a host's snapshot "
                                                         "listing before it places by the host's last one.")
    mcp = Bool(True, config=True, help="Serve the MCP server (streamable HTTP) at {base_url}{route_prefix}mcp; "
                                       "needs the mcp package (pip install 'forkd-jupyter[mcp]').")

    @default("remote_url")
    def _default_remote_url(self) -> str:
        return os.environ.get("FORKD_URL", "")

    @default("remote_token")
    def _default_remote_token(self) -> str:
        return default_token()

    @validate("remote_url")
    def _valid_remote_url(self, proposal):
        value = proposal["value"].strip()
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"remote_url must be an http:// or https:// URL, not {value!r}")
        return value

    @default("data_dir")
    def _default_data_dir(self) -> str:
        return default_data_dir()

    @validate("branch_concurrency")
    def _valid_cap(self, proposal):
        if proposal["value"] < 1:
            raise ValueError("branch_concurrency must be at least 1")
        return proposal["value"]

    @validate("max_long_calls", "max_long_calls_per_caller", "control_workers")
    def _valid_pool(self, proposal):
        if proposal["value"] < 1:
            raise ValueError(f"{proposal['trait'].name} must be at least 1")
        return proposal["value"]

    @validate("max_sandboxes")
    def _valid_max_sandboxes(self, proposal):
        if proposal["value"] is not None and proposal["value"] < 0:
            raise ValueError("max_sandboxes must be at least 0")
        return proposal["value"]

    @validate("sandbox_queue_size")
    def _valid_queue(self, proposal):
        if proposal["value"] < 0:
            raise ValueError("sandbox_queue_size must be at least 0")
        return proposal["value"]

    @validate("route_prefix")
    def _valid_prefix(self, proposal):
        value = proposal["value"].strip("/")
        return value + "/" if value else ""

    controller = None
    listing_json: tuple | None = None  # (registry generation, each sandbox's encoded JSON)
    event_owners = None  # under JupyterHub: the labels behind each event (hub/events.py)

    remote = None  # remote mode: the server every call is passed on to (remote.py)
    relay = None   # and the reader of its change events
    router_mode = None  # router mode: the fleet's router these routes are (fleet/extension.py)

    def initialize_settings(self) -> None:
        from .fleet.discovery import host_list
        if host_list(self.router_hosts) or self.router_hosts_dns.strip() or self.router_register_token_file:
            self._initialize_router()
            return
        if self.remote_url:
            self._initialize_remote()
            return
        startup.mark("server configured")
        from .controller import Controller
        from .controller.datadir_lock import DataDirBusy, DataDirLock

        try:  # one server per data dir (datadir_lock.py says why)
            self.data_dir_lock = DataDirLock.acquire(os.path.expanduser(self.data_dir))
        except DataDirBusy as exc:
            self.log.critical("forkd: %s", exc)
            self.serverapp.exit(1)  # as jupyter_server refuses root without --allow-root
        from .errors import ForkdError
        options = {k: v for k, v in (("endpoint", self.store_endpoint), ("region", self.store_region)) if v}
        options["timeout"] = self.store_timeout
        try:
            # The port listens first: what outlived the previous server is settled on threads
            # from then on (listening(), below), and calls about an object not settled yet answer
            # 503 (recovery.py).
            self.controller = Controller(os.path.expanduser(self.data_dir), branch_concurrency=self.branch_concurrency,
                                         default_engine=self.default_engine, store=self.store or None,
                                         store_options=options, recover_in_background=True,
                                         probe_timeout=self.recovery_probe_timeout,
                                         max_sandboxes=self.max_sandboxes)
        except ForkdError as exc:  # a store URL that cannot be used: said, and the server does not start
            self.log.critical("forkd: %s", exc)
            raise
        self.controller.recovery.on_done = self._recovered  # logs what the start-up repaired or resumed
        if self.store:
            self.log.info("forkd: remote snapshot store %s", self.controller.stores.remote.url)
        from .controller.kernels import KernelHeads
        from .controller.sessions import SessionManager
        self.sessions = SessionManager(self.controller, max_sessions=self.max_sessions)
        self.kernels = KernelHeads(self.controller.registry, self.controller.publish)
        self.controller.trees.kernels = self.kernels  # a promote never kills a notebook's HEAD
        self.metrics = Metrics(self)
        from .controller.admission import Admission
        self.admission = Admission(max_long_calls=self.max_long_calls,
                                   max_long_calls_per_caller=self.max_long_calls_per_caller,
                                   control_workers=self.control_workers, sandbox_queue_size=self.sandbox_queue_size,
                                   sandbox_queue_timeout=self.sandbox_queue_timeout, registry=self.metrics.registry)
        from .loop_calls import LoopCalls
        self.loop_calls = LoopCalls(self.admission, registry=self.metrics.registry)
        self.events = EventHub(self)
        io_loop = getattr(self.serverapp, "io_loop", None)  # the loop the server will run
        self.events.loop = getattr(io_loop, "asyncio_loop", None)
        self.event_owners = None
        from .hub.identity import HubIdentityProvider
        if isinstance(getattr(self.serverapp, "identity_provider", None), HubIdentityProvider):
            # before the event hub: an object's labels are noted before any stream sends its event
            from .hub.events import EventOwners
            self.event_owners = EventOwners(self.controller)
            self._unsubscribe_owners = self.controller.subscribe(self.event_owners.record)
        self._unsubscribe = self.controller.subscribe(self.events.from_thread)
        self.started = time.time()
        logger = getattr(self.serverapp, "event_logger", None)
        if logger is not None and EVENT_SCHEMA_ID not in logger.schemas.schema_ids:
            logger.register_event_schema(EVENT_SCHEMA)
        self.log.info("forkd: data in %s, routes under %s%s", self.controller.data_dir,
                      self.serverapp.base_url, self.route_prefix)
        startup.mark("extension ready")

    def _initialize_remote(self) -> None:
        """Remote mode: no controller, data dir or sandboxes here; calls and events come from the remote."""
        from .remote import EventRelay, Remote
        self.remote = Remote(self.remote_url, self.remote_token)
        self.events = EventHub(self)  # the relay's changes go to jupyter_server's event bus through it
        io_loop = getattr(self.serverapp, "io_loop", None)
        self.events.loop = getattr(io_loop, "asyncio_loop", None)
        self.relay = EventRelay(self.remote, self.events.publish, self.log)
        logger = getattr(self.serverapp, "event_logger", None)
        if logger is not None and EVENT_SCHEMA_ID not in logger.schemas.schema_ids:
            logger.register_event_schema(EVENT_SCHEMA)
        if self.register:
            self.log.warning("forkd: c.ForkdApp.register is ignored: this server passes its calls on to %s",
                             self.remote.url)
        self.log.info("forkd: routes under %s%s pass every call on to %s (c.ForkdApp.remote_url%s); no sandboxes "
                      "run here", self.serverapp.base_url, self.route_prefix, self.remote.url,
                      ", from $FORKD_URL" if self.remote_url == os.environ.get("FORKD_URL", "").strip() else "")

    def _initialize_router(self) -> None:
        """Router mode: no controller here; the router's state lives under the data dir."""
        from .fleet.extension import RouterMode, RouterModeError
        try:
            self.router_mode = RouterMode.configure(self)
        except RouterModeError as exc:  # said, and the server does not start (as for a busy data dir)
            self.log.critical("forkd: %s", exc)
            self.serverapp.exit(1)
        self.events = EventHub(self)  # the fleet's changes go to jupyter_server's event bus through it
        io_loop = getattr(self.serverapp, "io_loop", None)
        self.events.loop = getattr(io_loop, "asyncio_loop", None)
        logger = getattr(self.serverapp, "event_logger", None)
        if logger is not None and EVENT_SCHEMA_ID not in logger.schemas.schema_ids:
            logger.register_event_schema(EVENT_SCHEMA)

    def _recovered(self, result: dict) -> None:
        """Called on the recovery thread once every object it found is settled."""
        settled = self.controller.recovery.settled_s if self.controller else None
        for line in result["findings"]:
            self.log.warning("forkd: recovery: %s", line)
        self.log.info("forkd: recovery settled in %.2f s: %s", settled or 0.0,
                      ", ".join(f"{k} {v}" for k, v in result.items() if k != "findings"))

    def initialize_handlers(self) -> None:
        from .handlers import route_table

        if self.router_mode is not None:
            self.handlers.extend(self.router_mode.routes(self.route_prefix))
        elif self.remote is not None:
            from .handlers.meta import VersionHandler
            from .remote import routes
            # /version stays this extension's own: the Lab extension checks it matches its build
            self.handlers.append((f"/{self.route_prefix}version", VersionHandler))
            self.handlers.extend(routes(self.route_prefix))
        else:
            self.handlers.extend(route_table(self.route_prefix))
        from .mcp.http import routes as mcp_routes
        self.handlers.extend(mcp_routes(self.route_prefix))

    async def _start_jupyter_server_extension(self, serverapp) -> None:
        self.events.loop = asyncio.get_running_loop()
        if self.router_mode is not None:
            await self.router_mode.start()
            return
        if self.remote is not None:
            self.relay.start()
            return
        startup.mark("listening")  # the port was bound by the loop's first callback, just before
        self.controller.listening()  # what outlived the previous server settles from now on (recovery.py)
        if getattr(serverapp, "answers_plain_pings", False):  # forkd serve: its token is the only way in
            from .plain_ping import PlainPings
            self.plain_pings = PlainPings(self, serverapp)
            self.plain_pings.install()
        self.log.info("forkd: listening %s", startup.summary())
        prefix = self.route_prefix.rstrip("/")
        self.data_dir_lock.announce(serverapp.connection_url.rstrip("/") + (f"/{prefix}" if prefix else ""))
        if self.register:
            from .announce import Announcer
            from .serve import read_token_file
            token = read_token_file(self.register_token_file, "--register-token-file")
            self.announcer = Announcer(self.register, token, self.advertise_url, self.log)
            self.announcer.start()

    announcer = None  # this host announcing itself to a fleet's router (announce.py), with --register

    plain_pings = None  # forkd serve's pings answered without a RequestHandler (plain_ping.py)

    mcp_mount = None  # the MCP server's session manager, from the first request to it (mcp/http.py)

    def mcp_server(self):
        """The MCP mount, started on first use (importing the mcp SDK would cost every server start
        ~0.65 s of CPU); raises ``LookupError`` saying why there is none."""
        if self.mcp_mount is None:
            from .mcp import missing_sdk
            why = "it is off (c.ForkdApp.mcp = False)" if not self.mcp else missing_sdk()
            if why:
                raise LookupError(why)
            from .client import Controller
            from .mcp._in_process import InProcess
            from .mcp.http import McpMount, own_url
            token = getattr(self.serverapp.identity_provider, "token", None) or None
            url = own_url(self.serverapp, self.route_prefix)
            # this server's own controller for the quick calls; a remote or router mode has none here
            quick = InProcess(self, url) if self.controller is not None else None
            self.mcp_mount = McpMount(Controller(url, token), quick)
            self.mcp_mount.start()
        return self.mcp_mount

    def _forget_forkd_kernels(self) -> None:
        """Forget the HEADs of this server's forkd kernels: they stop with it. jupyter_server stops
        listening, then its extensions, then its kernels, so their shutdown cannot reach forkd to kill
        what they started and forget their HEAD; the record stayed, and after a restart the panel marked
        a sandbox HEAD of a kernel that was gone, beside the HEAD of the notebook's next kernel. Their
        sandboxes keep running, as after a kernel's crash, labelled with their notebook."""
        manager = getattr(self.serverapp, "kernel_manager", None)
        running = set(manager.list_kernel_ids()) if manager is not None else set()
        for kernel in self.kernels.list():
            if kernel["kernel_id"] in running:
                self.kernels.leave(kernel["kernel_id"])  # the notebook's next kernel is told where it ran

    async def stop_extension(self) -> None:
        if self.announcer is not None:
            await self.announcer.stop()
            self.announcer = None
        if self.mcp_mount is not None:
            await self.mcp_mount.stop()
            self.mcp_mount = None
        # jupyter_server stops its kernels after its extensions: their records are marked left first
        running = list(self.serverapp.kernel_manager.list_kernel_ids()) if getattr(
            self.serverapp, "kernel_manager", None) is not None else []
        if self.router_mode is not None:
            await self.router_mode.leave_kernels(running)
            await self.router_mode.stop()
            self.events.close()
            return
        if self.remote is not None:
            await self.remote.leave_kernels(running, self.log)
            await self.relay.stop()
            self.events.close()
            await self.remote.close()
            return
        if self.controller is None:
            return
        self._forget_forkd_kernels()
        self.events.close()
        self.sessions.close_all()
        self._unsubscribe()
        if self.event_owners is not None:
            self._unsubscribe_owners()
        self.admission.close()
        self.controller.close()
        self.controller = None
        self.data_dir_lock.release()
