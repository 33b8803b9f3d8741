"""``forkd router``: the tornado application and its start-up (options checked like forkd serve's)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import ssl
import sys

from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from .discovery import DiscoveryError, parse_dns, url_problem
from .handlers import route_table
from . import settling
from .registration import Registrations
from .router import Router, Settings

MAX_BODY = 64 * (1 << 20) + (1 << 20)  # a file write (64 MiB) and then some: the host says 413 past its limit


class RouterError(Exception):
    """A configuration ``forkd router`` refuses; the message says what to do."""


def parse_hosts(value: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in (value or "").split(",") if u.strip()]
    if not urls:
        raise RouterError("--hosts is empty: give the hosts' URLs, e.g. --hosts http://10.0.0.1:8889,http://10.0.0.2:8889")
    for url in urls:
        if why := url_problem(url):
            raise RouterError(f"--hosts: {url!r} is not a host's URL: {why}")
    if len(set(urls)) != len(urls):
        raise RouterError("--hosts names a host twice")
    return urls


class PrefixedApplication(web.Application):
    """The routes under ``base_url`` too (``/services/forkd/v1/...`` as the Hub's proxy forwards them,
    unstripped): the prefix is taken off before routing, so handlers and hosts see ``/v1/...``."""

    def __init__(self, *args, base_url: str = "/", **kwargs):
        super().__init__(*args, **kwargs)
        self.base_url = "/" + base_url.strip("/") + "/" if base_url.strip("/") else "/"

    def find_handler(self, request, **kwargs):
        if self.base_url != "/" and (request.path + "/").startswith(self.base_url):
            cut = len(self.base_url) - 1
            request.path, request.uri = request.path[cut:] or "/", request.uri[cut:] or "/"
        return super().find_handler(request, **kwargs)


def make_app(router: Router, token: str | None, hub: bool = False, base_url: str = "/", **settings) -> web.Application:
    """``hub``: JupyterHub checks every caller and each user sees only what they made (hub.py);
    ``token`` is then an operator's."""
    forkd_hub = None
    if hub:
        from .hub import RouterHub
        forkd_hub = RouterHub(router, token)
    return PrefixedApplication(route_table(), base_url=base_url, forkd_router=router, forkd_token=token,
                               forkd_hub=forkd_hub, websocket_max_message_size=256 << 20, **settings)


async def start(router: Router, token: str | None, host: str, port: int, ssl_options=None, hub: bool = False,
                base_url: str = "/", **settings) -> HTTPServer:
    """Start the router's heartbeat and listen; returns the server (its port in ``.port``)."""
    app = make_app(router, token, hub=hub, base_url=base_url, **settings)  # first: hub.py hooks the router
    sockets = bind_sockets(port, host)  # before the heartbeat: a port in use is refused with nothing started
    try:
        await router.start()
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    settling.watch(router)  # forks across hosts that a router killed mid-fork left
    server = HTTPServer(app, ssl_options=ssl_options, max_body_size=MAX_BODY, xheaders=False)
    server.add_sockets(sockets)
    server.port = sockets[0].getsockname()[1]
    return server


def run_router(hosts: str | None, hosts_token_file: str | None, host: str | None = None, port: int | None = None,
               token_file: str | None = None, no_token: bool = False, tls_cert: str | None = None,
               tls_key: str | None = None, data_dir: str | None = None, settings: Settings | None = None,
               hosts_dns: str | None = None, register_token_file: str | None = None, hub: bool | None = None) -> int:
    """``hub``: JupyterHub checks every caller (fleet/hub.py); None turns it on when JupyterHub
    started this process as a service, whose environment then also says where to listen."""
    from ..controller import default_data_dir
    from ..hub import hub_settings, managed_by_hub, missing_environment
    from ..serve import ServeError, is_loopback, read_token_file

    hub = managed_by_hub() if hub is None else hub
    where = hub_settings() if hub else {}
    host = host or where.get("host") or "127.0.0.1"
    port = port if port is not None else where.get("port", 8890)
    base_url = where.get("base_url", "/")
    try:
        if hub:
            if no_token:
                raise RouterError("--no-token and --hub do not go together: under JupyterHub the Hub checks every token")
            try:
                import jupyterhub.services.auth  # noqa: F401 - HubAuth, used from the first request on
            except ImportError:
                raise RouterError("--hub needs the jupyterhub package: pip install 'forkd-jupyter[hub]'") from None
            if missing := missing_environment():
                raise RouterError(f"--hub needs {' and '.join(missing)} in the environment, which JupyterHub gives "
                                  f"the services it starts; for one started apart see docs/deploy/jupyterhub.md")
        if hosts and hosts_dns:
            raise RouterError("give the hosts either as a list (--hosts URL,URL...) or as a name that resolves to "
                              "them (--hosts-dns http://NAME:PORT), not both")
        if not (hosts or hosts_dns or register_token_file):
            raise RouterError("give the hosts: a list (--hosts URL,URL...), a name that resolves to them (--hosts-dns "
                              "http://NAME:PORT), or let them register themselves (--register-token-file FILE, with "
                              "forkd serve --register on each host)")
        urls = parse_hosts(hosts) if hosts else []
        if hosts_dns:
            parse_dns(hosts_dns)
        if bool(tls_cert) != bool(tls_key):
            raise RouterError("--tls-cert and --tls-key go together")
        for path in (tls_cert, tls_key, settings and settings.hosts_ca):
            if path and not os.path.isfile(path):
                raise RouterError(f"TLS file not found: {path}")
        host_token = read_token_file(hosts_token_file, "--hosts-token-file") if hosts_token_file else None
        register_token = read_token_file(register_token_file, "--register-token-file") if register_token_file else None
        if token_file:
            token = read_token_file(token_file)
        elif hub:
            token = None  # the Hub vouches for every caller; no operator token unless one is given
        elif not is_loopback(host):
            raise RouterError(f"refusing to listen on {host} (not a loopback address) without a token: pass "
                              f"--token-file FILE (a secret of 16+ bytes)")
        elif no_token:
            token = None
        else:
            raise RouterError("pass --token-file FILE (the token clients of the router send), or --no-token on a "
                              "loopback address")
    except (RouterError, ServeError, DiscoveryError) as exc:
        print(f"forkd router: {exc}", file=sys.stderr)
        return 2
    ssl_options = None
    if tls_cert:
        ssl_options = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_options.load_cert_chain(tls_cert, tls_key)
    state_dir = os.path.join(os.path.abspath(os.path.expanduser(data_dir or default_data_dir())), "router")
    logging.basicConfig(level=logging.INFO, format="[forkd router %(asctime)s] %(message)s")
    logging.getLogger("tornado.access").setLevel(logging.WARNING)

    async def main() -> None:
        router = Router(urls, host_token, os.path.join(state_dir, "router.db"), settings, dns=hosts_dns)
        registrations = None
        if register_token:
            registrations = Registrations(router, register_token, urls)
            registrations.restore()
        server = await start(router, token, host, port, ssl_options, hub=hub, base_url=base_url,
                             forkd_registrations=registrations)
        if registrations is not None:
            registrations.start()
        scheme = "https" if tls_cert else "http"
        shown = f"[{host}]" if ":" in host else host
        up = sum(h.up for h in router.hosts.values())
        print(f"forkd router: listening on {scheme}://{shown}:{server.port}{base_url.rstrip('/')} for "
              f"{len(router.hosts)} hosts ({up} up{', found through ' + hosts_dns if hosts_dns else ''}"
              f"{'; hosts may register themselves at /v1/fleet/register' if registrations else ''}); "
              f"state in {state_dir}", file=sys.stderr, flush=True)
        for h in router.hosts.values():
            if not h.up:  # say why now: a router that cannot read a host would otherwise just lack it
                why = h.reason or h.last_error or "no answer yet"
                fix = ("; pass --hosts-token-file FILE, the token the hosts were started with"
                       if "answered 401" in why else "")
                print(f"forkd router: host {h.url} is not up: {why}{fix}", file=sys.stderr, flush=True)
        if hub:
            gate = server.request_callback.settings["forkd_hub"].gate
            print(f"forkd router: JupyterHub authenticates every request (a Hub token with "
                  f"{' or '.join(sorted(gate.access_scopes()))}); each user sees only what they made"
                  + ("; the --token-file token acts as an operator" if token else ""), file=sys.stderr, flush=True)
        else:
            print(f"forkd router: clients use it as one host: export FORKD_URL={scheme}://{shown}:{server.port} "
                  f"FORKD_TOKEN=<the token in {token_file}>" if token else
                  f"forkd router: no token: anyone on this host can use it (loopback only); "
                  f"export FORKD_URL={scheme}://{shown}:{server.port}", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.stop()
        if registrations is not None:
            await registrations.stop()
        await router.stop()

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        shown = f"[{host}]" if ":" in host else host
        print(f"forkd router: {shown}:{port} is already in use by another process: pass --port N", file=sys.stderr)
        return 2
    return 0
