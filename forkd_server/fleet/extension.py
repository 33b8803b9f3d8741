"""The router as a mode of the jupyter-server extension: with ``c.ForkdApp.router_hosts`` (or
``router_hosts_dns``), ``{base_url}forkd/`` is the fleet's router, as ``forkd router`` is on a port
of its own. No sandboxes run in the Jupyter server; its kernels, magics, SDK clients and Lab panel
find it as they find any forkd in it (``jpserver-*.json``, ``{url}forkd``) and their work is placed
on the hosts.

- The routes are the router's own handlers (handlers/), each mounted with ``JupyterAuth`` in front:
  the Jupyter server decides who calls (its token, its login cookie with the XSRF check, its
  authorizer), where ``forkd router`` checks its ``--token-file``. Refusals keep forkd's words (401
  ``missing bearer token``); ``/healthz`` stays public.
- Hosts may also register themselves (``router_register_token_file``, registration.py): that route
  takes the registration token, as ``forkd router``'s does, not a Jupyter login.
- The ``Router`` (router.py) is made at start-up with its state file under the data dir
  (``router/router.db``, as ``forkd router --data-dir``), starts its heartbeat and discovery on the
  server's loop and stops with the server.
- Its merged events also go to jupyter_server's event bus, which keeps the Lab panel live.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from urllib.parse import quote

from jupyter_server._tz import utcnow
from jupyter_server.auth.decorator import allow_unauthenticated, ws_authenticated
from jupyter_server.base.handlers import JupyterHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from jupyter_server.utils import url_path_join
from tornado import web

from ..handlers.base import ApiError, in_forkd_words
from ..kernel_handlers import SAFE_ID, checkout_in_kernel
from ..session_handler import RelayedSession
from .discovery import DiscoveryError, host_list, parse_dns
from .handlers import route_table
from .handlers.base import RouterHandler
from .handlers.workspaces import KernelHandler
from .hosts import HostError
from . import left, settling
from .registration import Registrations
from .router import Refusal, Router, Settings
from .session import HostSession, SessionProxy

# What a Jupyter server's request carries for Jupyter only: never passed on to a host.
JUPYTER_HEADERS = frozenset({"x-xsrftoken", "x-csrftoken"})
RUNS_CODE = ("exec", "eval", "run")  # in a sandbox; a kernel's checkout runs a line in the notebook's kernel
# Options of a server that runs sandboxes itself, which a router has no use for.
LOCAL_ONLY = ("default_engine", "max_sandboxes", "store", "store_endpoint", "store_region", "branch_concurrency",
              "allow_host_network", "register")


class RouterModeError(Exception):
    """A configuration of router mode the server refuses to start with; the message says what to do."""


class RouterMode:
    """The router of a Jupyter server in router mode: made from ``app``'s options (``configure``),
    started and stopped with the server."""

    def __init__(self, app, router: Router, registrations: Registrations | None = None):
        self.app, self.router, self.registrations = app, router, registrations
        self._bridge: asyncio.Task | None = None

    @classmethod
    def configure(cls, app) -> RouterMode:
        """Check ``app``'s options (RouterModeError says what is wrong) and make the router."""
        from ..serve import ServeError, read_token_file
        from .app import RouterError, parse_hosts

        hosts, dns = host_list(app.router_hosts), app.router_hosts_dns.strip()
        option = "c.ForkdApp." + ("router_hosts" if hosts else "router_hosts_dns" if dns else
                                  "router_register_token_file")
        if app.remote_url:
            source = " (from $FORKD_URL)" if app.remote_url == os.environ.get("FORKD_URL", "").strip() else ""
            raise RouterModeError(
                f"{option} (router mode: this server places "
                f"sandboxes on the hosts) and c.ForkdApp.remote_url = {app.remote_url!r}{source} (remote mode: this "
                f"server passes every call on to another forkd) do not go together: drop one (for router mode, "
                f"--ForkdApp.remote_url='' or unset FORKD_URL where the server starts)")
        local = [name for name in LOCAL_ONLY if name in app.config.get("ForkdApp", {})]
        if local:
            raise RouterModeError(
                f"{option} (router mode: no sandboxes run here, "
                f"the hosts run them) and {', '.join('c.ForkdApp.' + n for n in local)} (a server that runs "
                f"sandboxes itself) do not go together: set {'it' if len(local) == 1 else 'them'} on the hosts "
                f"(forkd serve), or drop router mode")
        if hosts and dns:
            raise RouterModeError("give the hosts either as a list (c.ForkdApp.router_hosts) or as a name that "
                                  "resolves to them (c.ForkdApp.router_hosts_dns), not both")
        try:
            urls = parse_hosts(",".join(hosts)) if hosts else []
            if dns:
                parse_dns(dns)
            token = (read_token_file(app.router_hosts_token_file, "c.ForkdApp.router_hosts_token_file")
                     if app.router_hosts_token_file else None)
            register = (read_token_file(app.router_register_token_file, "c.ForkdApp.router_register_token_file")
                        if app.router_register_token_file else None)
        except (RouterError, DiscoveryError, ServeError) as exc:
            raise RouterModeError(str(exc).replace("--hosts-dns", "c.ForkdApp.router_hosts_dns")
                                  .replace("--hosts", "c.ForkdApp.router_hosts")) from None
        if app.router_hosts_ca and not os.path.isfile(app.router_hosts_ca):
            raise RouterModeError(f"c.ForkdApp.router_hosts_ca: TLS file not found: {app.router_hosts_ca}")
        for name in ("router_heartbeat", "router_down_after", "router_host_timeout", "router_placement_wait"):
            if getattr(app, name) <= 0:
                raise RouterModeError(f"c.ForkdApp.{name} must be more than 0 seconds, not {getattr(app, name)}")
        settings = Settings(heartbeat=app.router_heartbeat, down_after=app.router_down_after,
                            host_timeout=app.router_host_timeout, placement_wait=app.router_placement_wait,
                            hosts_ca=app.router_hosts_ca or None)
        state_dir = os.path.join(os.path.abspath(os.path.expanduser(app.data_dir)), "router")
        try:
            router = Router(urls, token, os.path.join(state_dir, "router.db"), settings, dns=dns or None)
        except (OSError, sqlite3.Error) as exc:
            raise RouterModeError(f"cannot keep the router's host table and pins in {state_dir}: {exc}; set "
                                  f"c.ForkdApp.data_dir (or $FORKD_DATA_DIR) to a directory this server may "
                                  f"write") from None
        registrations = None
        if register:
            registrations = Registrations(router, register, urls)
            registrations.restore()  # the hosts that registered before, each given --down-after to announce
        return cls(app, router, registrations)

    @property
    def state_dir(self) -> str:
        return os.path.dirname(self.router.state.path)

    def routes(self, prefix: str) -> list[tuple[str, type]]:
        """The router's routes under ``/{prefix}``, each behind the Jupyter server's own login (but
        ``/healthz`` and hosts registering themselves, with the registration token). Not its
        catch-all: the Jupyter server's other routes are not the router's."""
        out = []
        for pattern, handler in route_table():
            if pattern == r"/.*":
                pattern = r"/v1/.*"
            if pattern.endswith("/checkout"):
                handler = KernelCheckout
            mounted = RouterSession if handler is SessionProxy else mount(handler)
            out.append((f"/{prefix}{pattern[1:]}", mounted))
        return out

    async def start(self) -> None:
        await self.router.start()
        settling.watch(self.router)  # forks across hosts that a router killed mid-fork left
        if self.registrations is not None:
            self.registrations.start()
        self._bridge = asyncio.ensure_future(self._to_event_bus())
        up = sum(h.up for h in self.router.hosts.values())
        where = f"{self.app.serverapp.base_url}{self.app.route_prefix}"
        self.app.log.info("forkd: router mode: %s places sandboxes on %d hosts (%d up%s%s); state in %s", where,
                          len(self.router.hosts), up,
                          f", found through {self.app.router_hosts_dns}" if self.router.dns else "",
                          f"; hosts may register themselves at {where}v1/fleet/register" if self.registrations
                          else "", self.state_dir)
        for host in self.router.hosts.values():
            if not host.up:  # said now: a router that cannot read a host would otherwise just lack it
                why = host.reason or host.last_error or "no answer yet"
                fix = ("; set c.ForkdApp.router_hosts_token_file to the file of the token the hosts were started "
                       "with" if "answered 401" in why else "")
                self.app.log.warning("forkd: host %s is not up: %s%s", host.url, why, fix)

    async def _to_event_bus(self) -> None:
        """The fleet's events onto jupyter_server's event bus, as the extension's own are."""
        queue = self.router.events.subscribe()
        try:
            while (event := await queue.get()) is not None:
                self.app.events.publish({k: v for k, v in event.items() if k != "seq"})
        finally:
            self.router.events.unsubscribe(queue)

    async def leave_kernels(self, kernel_ids) -> None:
        """Mark left the records of this server's forkd kernels as it stops (their shutdown cannot
        reach the router then): each notebook's next kernel says where its state runs, whichever
        host it lands on (left.py). A kernel no host knows (not forkd's) is skipped; a host that
        does not answer, logged."""
        async def leave(kernel_id: str) -> None:
            try:
                host = await self.router.locate("kernel", kernel_id)
            except Refusal:
                return
            try:
                status, reply = await left.leave(self.router, host, kernel_id)
            except HostError as exc:
                self.app.log.warning("forkd: could not mark kernel %s left on %s: %s", kernel_id, host.url, exc)
                return
            if status in (204, 404):
                self.router.state.unpin("kernel", kernel_id, host.url)
            else:
                self.app.log.warning("forkd: could not mark kernel %s left on %s (%s: %s)", kernel_id, host.url,
                                     status, reply)
        await asyncio.gather(*(leave(k) for k in kernel_ids))

    async def stop(self) -> None:
        if self.registrations is not None:
            await self.registrations.stop()
        await self.router.stop()  # ends the bridge's subscription too
        if self._bridge is not None:
            await asyncio.gather(self._bridge, return_exceptions=True)


class JupyterAuth:
    """In front of a router handler mounted in a Jupyter server: the Jupyter server's login
    (its token, or its cookie with the XSRF check) and authorizer decide who calls, in forkd's
    words (401 ``missing bearer token``); the caller then sees everything (no per-user views, as
    with the router's own token)."""

    hub = None  # no JupyterHub views: a Jupyter server is one user's

    @property
    def router(self) -> Router:
        return self.extensionapp.router_mode.router

    @property
    def registrations(self):
        return self.extensionapp.router_mode.registrations

    @property
    def api_path(self) -> str:
        prefix = url_path_join(self.base_url, self.extensionapp.route_prefix)
        return "/" + self.request.path[len(prefix):].lstrip("/")

    async def prepare(self) -> None:
        # no login page: an API answers 401
        await in_forkd_words(self, JupyterHandler.prepare(self, _redirect_to_login=False))
        if not self.check_origin():
            raise Refusal(404, "not found: a request from another origin")
        if self.current_user is not None and self.get_argument("no_track_activity", None) is None:
            self.settings["api_last_activity"] = utcnow()  # the server's activity, as any API call's (idle culling)
        await super().prepare()  # the router handler's own: admit(), below

    def _unauthorized(self) -> Refusal:
        header = self.request.headers.get("Authorization", "").strip()
        sent = header.split(None, 1)[0].lower() in ("bearer", "token") if header else bool(
            self.get_query_argument("token", ""))
        return Refusal(401, "invalid bearer token" if sent else "missing bearer token")

    async def admit(self) -> None:
        last = self.api_path.rsplit("/", 1)[-1]
        runs = self.request.method == "POST" and last in (*RUNS_CODE, "checkout")
        action = "execute" if runs else "read" if self.request.method in ("GET", "HEAD") else "write"
        resource = "forkd:sandboxes" if runs and last in RUNS_CODE else self.auth_resource
        allowed = self.authorizer.is_authorized(self, self.current_user, action, resource)
        if not (await allowed if asyncio.iscoroutine(allowed) else allowed):
            raise Refusal(403, getattr(self, "forkd_refusal", None)
                          or f"the Jupyter server's authorizer does not let this user {action} {resource}")

    @property
    def sse_keepalive(self) -> float:
        return self.extensionapp.sse_keepalive

    def check_xsrf_cookie(self) -> None:
        if self.public:  # /healthz, and hosts registering with their own token: no login acts there
            return
        JupyterHandler.check_xsrf_cookie(self)  # a cookie carries authority here: the router's handler skips it

    def client_headers(self) -> dict:
        return {k: v for k, v in super().client_headers().items() if k.lower() not in JUPYTER_HEADERS}


class KernelCheckout(KernelHandler):
    """``POST /v1/kernels/{id}/checkout {"sandbox"}`` (the panel's "Check out"): the notebook's
    kernel runs in this Jupyter server, not on a host, so the checkout runs here, ``%forkd checkout``
    in that kernel (kernel_handlers.py), which then moves its HEAD through the router. A kernel of
    another Jupyter server is passed on as ``forkd router`` passes it."""

    auth_resource = "forkd:kernels"

    async def post(self, kernel_id: str, *_) -> None:
        manager = self.serverapp.kernel_manager
        if kernel_id not in manager.list_kernel_ids():
            await super().post(kernel_id)
            return
        body = self.json_body()
        target = body.get("sandbox") if body is not None else None
        if not isinstance(target, str) or not SAFE_ID.match(target):
            raise Refusal(422 if body is None or not isinstance(target, str) else 400,
                          'a checkout is {"sandbox": ID} sent as application/json: the id of a sandbox '
                          "(GET /v1/sandboxes names them)")
        await self.router.locate("sandbox", target)  # 404 saying how it ended (410: lost), before the kernel
        status, record = await self._record(kernel_id)
        try:
            await checkout_in_kernel(manager, kernel_id, target, record.get("notebook") if status == 200 else None)
        except ApiError as exc:
            raise Refusal(exc.status_code, exc.message) from None
        self.answer(*await self._record(kernel_id))

    async def _record(self, kernel_id: str) -> tuple[int, object]:
        """The kernel's record as its host has it now (as ``GET /v1/kernels/{id}`` answers it)."""
        host = await self.locate(kernel_id)
        try:
            status, record = await host.request_json("GET", f"/v1/kernels/{quote(kernel_id, safe='')}",
                                                     timeout=self.router.settings.host_timeout)
        except HostError as exc:
            raise Refusal(502, str(exc), host=host.url) from None
        return status, record


def mount(handler: type[RouterHandler]) -> type:
    """``handler`` as a Jupyter server's handler: ``JupyterAuth`` first, then the router's own."""
    attrs = {"__module__": __name__, "__doc__": handler.__doc__}
    if handler.public:  # /healthz, and hosts registering with a token of their own: no Jupyter login
        for verb in ("get", "post"):
            if getattr(handler, verb) is not getattr(web.RequestHandler, verb):
                attrs[verb] = allow_unauthenticated(getattr(handler, verb))
    return type(handler.__name__, (JupyterAuth, handler, ExtensionHandlerMixin, JupyterHandler), attrs)


class RouterSession(HostSession, RelayedSession):
    """The session WebSocket in router mode: the Jupyter server's login, then joined to the
    sandbox's host (session.py)."""

    @property
    def router(self) -> Router:
        return self.app.router_mode.router

    api_path = JupyterAuth.api_path

    @ws_authenticated
    async def get(self, sandbox_id: str) -> None:
        if not await self._authorized("execute"):
            raise web.HTTPError(403, "%s", getattr(self, "forkd_refusal", None)
                                or "not allowed to run code in sandboxes")
        if not await self.join_host(sandbox_id):
            return
        await self.accept(sandbox_id)
