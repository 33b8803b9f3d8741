"""``forkd serve``: a standalone jupyter-server carrying only the forkd extension, routes at the root.

Like forkd's daemon: 127.0.0.1:8889 by default, ``/healthz`` and ``/v1/...`` at the root, optional
TLS, a token from ``--token-file`` (or one generated and printed once), and a refusal to listen on
a non-loopback address without a token. Only forkd's routes are served: none of jupyter-server's
services (contents, files, kernels, shutdown, api, events...), static files or login pages, so a
token holder may run code in sandboxes, not on the host, and the data dir is never served. Tokens
are compared in constant time (identity.py).
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import secrets
import socket
import sys
from urllib.parse import urlsplit

from jupyter_server.serverapp import ServerApp
from tornado import web
from traitlets import default

from .access_log import access_log
from .app import ForkdApp
from .controller import default_data_dir
from .identity import ForkdIdentityProvider
from .startup import mark

mark("imports of jupyter-server and forkd_server")

PLACEHOLDER_PREFIXES = ("REPLACE_ME", "CHANGE_ME")


class ServeError(Exception):
    """A configuration ``forkd serve`` refuses; the message says what to do."""


class OutsideTheApi(web.RequestHandler):
    """Every path that is not forkd's: a JSON 404 (no Jupyter page, no file, whatever the method)."""

    def check_xsrf_cookie(self) -> None:
        pass  # nothing here changes state

    def prepare(self) -> None:
        self.set_status(404)
        self.set_header("Content-Type", "application/json")
        self.finish('{"error": "not found: forkd serve answers /healthz, /version, /metrics and /v1/... only"}')


class ForkdServerApp(ServerApp):
    """jupyter-server carrying forkd's routes and nothing of its own (no service reaches the host)."""

    name = "forkd-serve"
    default_services = ()

    @property
    def answers_plain_pings(self) -> bool:
        """plain_ping.py: with forkd's own identity provider the token is the only way in (under
        ``--hub`` the Hub's decides who may see what, and every ping is the handler's)."""
        return type(self.identity_provider) is ForkdIdentityProvider

    @default("identity_provider_class")
    def _forkd_identity(self):
        return ForkdIdentityProvider

    def init_webapp(self) -> None:
        super().init_webapp()
        # jupyter-server's own routes (the contents manager's /files/ rooted at the data dir, the
        # base handlers, static files, its 404 page) all sit in the wildcard router; extensions'
        # routes are added later, ahead of it. Only a JSON 404 is left there.
        self.web_app.wildcard_router.rules = []
        self.web_app.wildcard_router.add_rules([(r".*", OutsideTheApi)])
        settings = self.web_app.settings
        settings["log_function"] = access_log(settings["log_function"], self.record_http_request_metrics)


class _StandaloneForkd(ForkdApp):
    """Launcher only: the server instantiates ForkdApp itself from the extension point."""

    load_other_extensions = False
    serverapp_class = ForkdServerApp


def _port_in_use(host: str, port: int) -> bool:
    """Whether something else listens at host:port (jupyter-server's refusal then says only that the
    port is not available, in its log)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), port))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def read_token_file(path: str, option: str = "--token-file") -> str:
    """forkd's rules: trimmed, non-empty, at least 16 bytes, not a placeholder. ``option``: the
    flag that named the file, as the refusal says it."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ServeError(f"cannot read {option} {path}: {exc.strerror}") from None
    if not token:
        raise ServeError(f"{option} {path} is empty")
    if len(token.encode()) < 16:
        raise ServeError(f"the token in {path} is too short: use at least 16 bytes "
                         f"(e.g. `python3 -c 'import secrets; print(secrets.token_hex(24))' > {path}`)")
    if token.startswith(PLACEHOLDER_PREFIXES):
        raise ServeError(f"the token in {path} is a placeholder ({token.split()[0][:10]}...): put a real secret there")
    return token


def build_argv(host: str = "127.0.0.1", port: int = 8889, data_dir: str | None = None,
               token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
               no_token: bool = False, branch_concurrency: int | None = None,
               allow_host_network: bool = False, store: str | None = None, store_endpoint: str | None = None,
               store_region: str | None = None, max_sandboxes: int | None = None, hub: bool = False,
               base_url: str | None = None, register: str | None = None, register_token_file: str | None = None,
               advertise_url: str | None = None, store_timeout: float | None = None) -> tuple[list[str], str | None, bool]:
    """Validate the options; returns (server argv, token or None, whether the token was generated).
    ``hub``: JupyterHub authenticates every request (forkd_server/hub/); the token, if any, is an
    operator's."""
    if bool(tls_cert) != bool(tls_key):
        raise ServeError("--tls-cert and --tls-key go together")
    if store_timeout is not None and not 0 < store_timeout < math.inf:
        raise ServeError(f"--store-timeout must be a number of seconds above 0 (each request to the store has that long), "
                         f"got {store_timeout:g}")
    if max_sandboxes is not None and max_sandboxes < 0:
        raise ServeError(f"--max-sandboxes must be 0 or more (0: this host takes no new sandboxes), got {max_sandboxes}")
    if store:
        from forkd_engine.store.errors import StoreError
        from forkd_engine.store.remote import check_url
        try:
            check_url(store)
        except StoreError as exc:
            raise ServeError(f"--store: {exc}") from None
    for path in (tls_cert, tls_key):
        if path and not os.path.isfile(path):
            raise ServeError(f"TLS file not found: {path}")
    loopback = is_loopback(host)
    generated = False
    if token_file:
        token = read_token_file(token_file)
    elif hub:
        token = None  # the Hub vouches for every caller; no operator token unless one is given
    elif not loopback:
        raise ServeError(f"refusing to listen on {host} (not a loopback address) without a token: "
                         f"pass --token-file FILE (a secret of 16+ bytes)")
    elif no_token:
        token = None
    else:
        token, generated = secrets.token_hex(24), True
    data_dir = os.path.abspath(os.path.expanduser(data_dir or default_data_dir()))
    argv = [
        f"--ServerApp.ip={host}", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        "--ServerApp.open_browser=False", "--ServerApp.allow_root=True",
        "--ServerApp.allow_unauthenticated_access=False", "--ServerApp.answer_yes=True",
        "--ServerApp.default_url=/healthz", "--ForkdApp.default_url=/healthz",
        f"--ServerApp.root_dir={data_dir}", "--ForkdApp.route_prefix=", f"--ForkdApp.data_dir={data_dir}",
        "--ForkdApp.remote_url=",  # a host never forwards, whatever FORKD_URL its shell has
        # nor places, whatever a Jupyter config says
        "--ForkdApp.router_hosts=", "--ForkdApp.router_hosts_dns=", "--ForkdApp.router_register_token_file=",
        f"--IdentityProvider.token={token or ''}",
    ]
    if hub:
        from .hub import AUTHORIZER, IDENTITY
        argv += [f"--ServerApp.identity_provider_class={IDENTITY}", f"--ServerApp.authorizer_class={AUTHORIZER}"]
    if base_url:
        argv.append(f"--ServerApp.base_url={base_url}")
    if token is None and not hub:
        # No auth (loopback only, forkd's default without --token-file). Body routes insist on
        # Content-Type: application/json, which a cross-site form cannot send without CORS approval.
        argv.append("--ServerApp.disable_check_xsrf=True")
    if not loopback or hub:
        # Under the Hub, requests come through its proxy with the Hub's public name as Host, and
        # every one carries a token the Hub checks: the Host check (a guard for cookie logins
        # against DNS rebinding) has nothing to guard.
        argv.append("--ServerApp.allow_remote_access=True")
    if tls_cert:
        argv += [f"--ServerApp.certfile={tls_cert}", f"--ServerApp.keyfile={tls_key}"]
    if branch_concurrency is not None:
        argv.append(f"--ForkdApp.branch_concurrency={branch_concurrency}")
    if allow_host_network:
        argv.append("--ForkdApp.allow_host_network=True")
    if max_sandboxes is not None:
        argv.append(f"--ForkdApp.max_sandboxes={max_sandboxes}")
    for name, value in (("store", store), ("store_endpoint", store_endpoint), ("store_region", store_region),
                        ("store_timeout", store_timeout)):
        if value:
            argv.append(f"--ForkdApp.{name}={value}")
    argv += registration_argv(host, port, "https" if tls_cert else "http", base_url, register, register_token_file,
                              advertise_url)
    return argv, token, generated


WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def registration_argv(host: str, port: int, scheme: str, base_url: str | None, register: str | None,
                      token_file: str | None, advertise_url: str | None) -> list[str]:
    """The options of a host that registers itself with a fleet's router (announce.py), checked."""
    if not register:
        if token_file or advertise_url:
            raise ServeError("--register-token-file and --advertise-url go with --register ROUTER_URL")
        return []
    parts = urlsplit(register)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServeError(f"--register: {register!r} is not a router's URL: use http(s)://HOST:PORT (forkd router's "
                         f"address)")
    if not token_file:
        raise ServeError("--register needs --register-token-file FILE: the token the router was started with "
                         "(forkd router --register-token-file)")
    read_token_file(token_file, "--register-token-file")
    if advertise_url:
        own = urlsplit(advertise_url)
        if own.scheme not in ("http", "https") or not own.hostname or own.path not in ("", "/"):
            raise ServeError(f"--advertise-url: {advertise_url!r} is not this host's URL: use http(s)://HOST:PORT, "
                             f"the address the router reaches it at")
        url = advertise_url.rstrip("/")
    elif host in WILDCARDS:
        raise ServeError(f"--register: this host listens on every address ({host or 'all'}), so it cannot tell the "
                         f"router which one reaches it: pass --advertise-url http://ADDRESS:{port}")
    elif base_url and base_url.strip("/"):
        raise ServeError("--register with a base URL: pass --advertise-url, the URL the router reaches this host at")
    else:
        url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    return [f"--ForkdApp.register={register}", f"--ForkdApp.register_token_file={os.path.abspath(token_file)}",
            f"--ForkdApp.advertise_url={url}"]


def serve(host: str | None = None, port: int | None = None, data_dir: str | None = None,
          token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
          no_token: bool = False, branch_concurrency: int | None = None, allow_host_network: bool = False,
          store: str | None = None, store_endpoint: str | None = None, store_region: str | None = None,
          max_sandboxes: int | None = None, hub: bool | None = None, extra_args: list[str] | None = None,
          register: str | None = None, register_token_file: str | None = None, advertise_url: str | None = None,
          store_timeout: float | None = None) -> int:
    """``hub``: None turns it on when JupyterHub started this process as a service (hub/__init__.py);
    the Hub's environment then also gives the address and the URL prefix, unless given here."""
    from .hub import hub_settings, managed_by_hub
    hub = managed_by_hub() if hub is None else hub
    where = hub_settings() if hub else {}
    host = host or where.get("host") or "127.0.0.1"
    port = port if port is not None else where.get("port", 8889)
    try:
        if hub and no_token:
            raise ServeError("--no-token and --hub do not go together: under JupyterHub the Hub checks every token")
        if hub:
            from .hub import missing_environment
            try:
                import jupyterhub.services.auth  # noqa: F401 - HubAuth, used from the first request on
            except ImportError:
                raise ServeError("--hub needs the jupyterhub package: pip install 'forkd-jupyter[hub]'") from None
            if missing := missing_environment():
                raise ServeError(f"--hub needs {' and '.join(missing)} in the environment, which JupyterHub gives the "
                                 f"services it starts; for one started apart see docs/deploy/jupyterhub.md")
        argv, token, generated = build_argv(host, port, data_dir, token_file, tls_cert, tls_key, no_token,
                                            branch_concurrency, allow_host_network, store, store_endpoint,
                                            store_region, max_sandboxes, hub=hub, base_url=where.get("base_url"),
                                            register=register, register_token_file=register_token_file,
                                            advertise_url=advertise_url, store_timeout=store_timeout)
    except ServeError as exc:
        print(f"forkd serve: {exc}", file=sys.stderr)
        return 2
    os.makedirs(argv_value(argv, "--ForkdApp.data_dir"), mode=0o700, exist_ok=True)
    try:
        serverapp = _StandaloneForkd.initialize_server(argv=argv + list(extra_args or []))
    except SystemExit:
        if not _port_in_use(host, port):
            raise
        shown = f"[{host}]" if ":" in host else host
        print(f"forkd serve: {shown}:{port} is already in use by another process: pass --port N (if it is another "
              f"forkd serve, `forkd ls --url http://{shown}:{port}` reaches it)", file=sys.stderr)
        return 2
    if "forkd" not in serverapp.web_app.settings:
        print("forkd serve: the forkd extension failed to load (see the log above)", file=sys.stderr)
        return 1
    mark("web app built")
    serverapp.start_app()
    mark("server files written")
    scheme = "https" if tls_cert else "http"
    shown = f"[{host}]" if ":" in host else host
    url = f"{scheme}://{shown}:{serverapp.port}{serverapp.base_url.rstrip('/')}"
    lines = [f"forkd serve: listening on {url} (GET {url}/healthz; the API is under {url}/v1/)"]
    if hub:
        lines.append(f"forkd serve: JupyterHub authenticates every request (a Hub token with "
                     f"{' or '.join(sorted(serverapp.authorizer.access_scopes()))}); each user sees only what they made"
                     + ("; the --token-file token acts as an operator" if token else ""))
    elif generated:
        lines += ["forkd serve: generated a token; it is shown only this once (use --token-file to choose one):",
                  f"    export FORKD_URL={url} FORKD_TOKEN={token}"]
    elif token is None:
        lines.append("forkd serve: no token: anyone on this host can use the API (loopback only)")
    else:
        lines.append(f"forkd serve: clients need the token from --token-file: export FORKD_URL={url} FORKD_TOKEN=...")
    if register:
        lines.append(f"forkd serve: announcing {argv_value(argv, '--ForkdApp.advertise_url')} to the router at "
                     f"{register}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    serverapp.start_ioloop()
    return 0


def argv_value(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(name + "="))
