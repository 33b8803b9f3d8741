"""The commands about this host rather than a server's sandboxes: ``serve`` (run the API server),
``doctor`` (check the host), ``bench`` (latency through a server), ``demo`` (in-process, needs no
server) and ``image build`` (the VM engine's guest image)."""

from __future__ import annotations

import json
import os
import sys
import time

from ._errors import add_debug_option
from ._output import client, console, emit_json


def cmd_serve(args) -> int:
    from .. import startup
    startup.mark("python and the CLI")
    from ..serve import serve

    return serve(host=args.host, port=args.port, data_dir=args.data_dir, token_file=args.token_file,
                 tls_cert=args.tls_cert, tls_key=args.tls_key, no_token=args.no_token,
                 branch_concurrency=args.branch_concurrency, allow_host_network=args.allow_host_network,
                 store=args.store, store_endpoint=args.store_endpoint, store_region=args.store_region,
                 max_sandboxes=args.max_sandboxes, hub=args.hub, extra_args=args.jupyter_args,
                 register=args.register, register_token_file=args.register_token_file, advertise_url=args.advertise_url,
                 store_timeout=args.store_timeout)


def cmd_router(args) -> int:
    from ..fleet.app import run_router
    from ..fleet.router import Settings

    settings = Settings(heartbeat=args.heartbeat, down_after=args.down_after, host_timeout=args.host_timeout,
                        placement_wait=args.placement_wait, hosts_ca=args.hosts_ca)
    return run_router(args.hosts, args.hosts_token_file, host=args.host, port=args.port, token_file=args.token_file,
                      no_token=args.no_token, tls_cert=args.tls_cert, tls_key=args.tls_key, data_dir=args.data_dir,
                      settings=settings, hosts_dns=args.hosts_dns, register_token_file=args.register_token_file,
                      hub=args.hub)


def cmd_doctor(args) -> int:
    from rich.table import Table

    from ..controller import default_data_dir
    from ..doctor import run_checks

    data_dir = args.data_dir or default_data_dir()
    rows = run_checks(data_dir, url=args.url or os.environ.get("FORKD_URL"), token=args.token)
    if args.json:
        emit_json(rows)
    else:
        colour = {"ok": "green", "warn": "yellow", "fail": "red", "info": "cyan"}
        table = Table(title="forkd doctor", title_justify="left")
        for col in ("check", "status", "detail", "fix"):
            table.add_column(col, overflow="fold")
        for r in rows:
            c = colour.get(r["status"], "white")
            table.add_row(r["check"], f"[{c}]{r['status']}[/]", r["detail"], r.get("fix") or "")
        console().print(table)
    return 1 if any(r["status"] == "fail" and r.get("required") for r in rows) else 0


def cmd_bench(args) -> int:
    from ..bench import run_bench

    figures = run_bench(client(args), n=args.n, show=not args.json)
    if args.json:
        emit_json(figures)
    return 0


def cmd_demo(args) -> int:
    from ..demo import run_demo

    figures = run_demo(data_dir=args.data_dir, children=args.children, grandchildren=args.grandchildren,
                       mib=args.mib)
    if args.json:
        print(json.dumps(figures))
    checks = ("source_result_unchanged", "state_carried_to_grandchildren", "children_random_streams_distinct")
    return 0 if all(figures[c] for c in checks) else 1


def cmd_image_build(args) -> int:
    """Build (or reuse) the VM engine's guest image under the data dir: kernel + initramfs."""
    from forkd_engine.vm.image import ImageError, build_image

    from ..controller import default_data_dir

    data_dir = os.path.expanduser(args.data_dir or default_data_dir())
    t0 = time.monotonic()
    try:
        image = build_image(os.path.join(data_dir, "vm", "cache"),
                            log=None if args.json else lambda msg: print(msg, file=sys.stderr))
    except ImageError as exc:
        print(f"forkd image build: {exc}", file=sys.stderr)
        return 1
    out = dict(image.to_dict(), seconds=round(time.monotonic() - t0, 2))
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="run the API server (a standalone jupyter-server) on 127.0.0.1:8889")
    p.add_argument("--host", default=os.environ.get("FORKD_HOST"),
                   help="address to listen on (default: $FORKD_HOST, under JupyterHub the service's URL, else "
                        "127.0.0.1)")
    p.add_argument("--port", type=int, default=int(os.environ["FORKD_PORT"]) if os.environ.get("FORKD_PORT") else None,
                   help="port (default: $FORKD_PORT, under JupyterHub the service's URL, else 8889)")
    p.add_argument("--data-dir", default=os.environ.get("FORKD_DATA_DIR"),
                   help="state directory (default: $FORKD_DATA_DIR or ~/.local/share/forkd)")
    p.add_argument("--token-file", default=os.environ.get("FORKD_TOKEN_FILE"),
                   help="file holding the bearer token (16+ bytes); default: generate one and print it once")
    p.add_argument("--no-token", action="store_true", help="no authentication (loopback addresses only)")
    p.add_argument("--tls-cert", default=os.environ.get("FORKD_TLS_CERT"))
    p.add_argument("--tls-key", default=os.environ.get("FORKD_TLS_KEY"))
    p.add_argument("--branch-concurrency", type=int, default=None,
                   help="branches in flight at once (default 4)")
    p.add_argument("--max-sandboxes", type=int, default=os.environ.get("FORKD_MAX_SANDBOXES") or None, metavar="N",
                   help="the most sandboxes this host holds at once (default: $FORKD_MAX_SANDBOXES, else no cap); "
                        "a spawn past it is refused whole with 503, and /healthz reports it to a fleet's router")
    p.add_argument("--allow-host-network", action="store_true",
                   help="let callers create snapshots with host_network (their sandboxes reach every service on "
                        "this host's loopback, this server included); off by default: 403")
    p.add_argument("--store", default=os.environ.get("FORKD_STORE"),
                   help="remote snapshot store for push and pull: s3://bucket/prefix, gs://..., az://..., "
                        "file:///path (default: $FORKD_STORE); S3 credentials from AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY")
    p.add_argument("--store-endpoint", default=None,
                   help="S3-compatible endpoint URL (default: $AWS_ENDPOINT_URL)")
    p.add_argument("--store-region", default=None, help="S3 region (default: $AWS_REGION)")
    p.add_argument("--store-timeout", type=float, default=os.environ.get("FORKD_STORE_TIMEOUT"), metavar="SECONDS",
                   help="seconds each request to the store (a 4 MiB chunk, a manifest) has to finish before the push "
                        "or pull fails saying so (default: $FORKD_STORE_TIMEOUT, else 120)")
    p.add_argument("--register", default=os.environ.get("FORKD_REGISTER"), metavar="ROUTER_URL",
                   help="register this host with a fleet's router (forkd router --register-token-file) and keep "
                        "announcing it at the router's heartbeat (default: $FORKD_REGISTER)")
    p.add_argument("--register-token-file", default=os.environ.get("FORKD_REGISTER_TOKEN_FILE"),
                   help="file holding the token the router takes registrations with")
    p.add_argument("--advertise-url", default=os.environ.get("FORKD_ADVERTISE_URL"),
                   help="the URL the router reaches this host at (default: the address it listens on; needed when "
                        "that is 0.0.0.0)")
    add_hub_options(p, "made")
    add_debug_option(p)
    p.set_defaults(func=cmd_serve, jupyter_args=[])
    p.epilog = "Other jupyter-server options pass through, e.g. --ServerApp.log_level=DEBUG."


def add_hub_options(p, made: str) -> None:
    """--hub / --no-hub (unset: on when JupyterHub started the command); ``made``: what each user sees."""
    hub = p.add_mutually_exclusive_group()
    hub.add_argument("--hub", dest="hub", action="store_true", default=None,
                     help=f"run as a JupyterHub service: the Hub checks every token, each user sees only what they "
                          f"{made} (docs/deploy/jupyterhub.md); the default when JupyterHub started this command")
    hub.add_argument("--no-hub", dest="hub", action="store_false", default=None,
                     help="not as a JupyterHub service, even when JupyterHub started this command")


def add_router_command(sub) -> None:
    p = sub.add_parser("router", help="one /v1 in front of many `forkd serve` hosts: placement by where snapshots "
                                      "are, calls pinned to their sandbox's host, merged lists, tree and events")
    p.add_argument("--hosts", default=os.environ.get("FORKD_HOSTS"),
                   help="the hosts' URLs, comma-separated: http://10.0.0.1:8889,http://10.0.0.2:8889")
    p.add_argument("--hosts-dns", default=os.environ.get("FORKD_HOSTS_DNS"),
                   help="instead of --hosts: every address this URL's name resolves to, with its scheme and port, "
                        "resolved again on every heartbeat (a Kubernetes headless Service: "
                        "http://forkd-hosts.forkd.svc.cluster.local:8889)")
    p.add_argument("--hosts-token-file", default=os.environ.get("FORKD_HOSTS_TOKEN_FILE"),
                   help="file holding the token the hosts were started with (--token-file of forkd serve)")
    p.add_argument("--register-token-file", default=os.environ.get("FORKD_REGISTER_TOKEN_FILE"),
                   help="let hosts register themselves (forkd serve --register THIS_URL --register-token-file F) "
                        "with the token in this file; alone or beside --hosts / --hosts-dns")
    p.add_argument("--hosts-ca", default=None,
                   help="CA certificate file to check https hosts with (default: the system's CAs)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; under JupyterHub, "
                                                "where JUPYTERHUB_SERVICE_URL says)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 8890; under JupyterHub, "
                                                          "JUPYTERHUB_SERVICE_URL's)")
    p.add_argument("--token-file", default=os.environ.get("FORKD_TOKEN_FILE"),
                   help="file holding the bearer token clients of the router send (16+ bytes); with --hub an "
                        "operator's, optional")
    p.add_argument("--no-token", action="store_true", help="no authentication (loopback addresses only)")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--data-dir", default=os.environ.get("FORKD_DATA_DIR"),
                   help="where the router keeps its host table and pins (router/router.db under it)")
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between two reads of a host's /healthz")
    p.add_argument("--down-after", type=float, default=10.0,
                   help="seconds without a good /healthz before a host is down (its sandboxes lost) (default 10)")
    p.add_argument("--host-timeout", type=float, default=5.0,
                   help="seconds a host has to answer the router's own reads: heartbeat, lists, lookups (default 5)")
    p.add_argument("--placement-wait", type=float, default=1.0,
                   help="seconds a spawn waits for a host's snapshot listing before it places by the host's last "
                        "one (default 1)")
    add_hub_options(p, "made on any host")
    add_debug_option(p)
    p.set_defaults(func=cmd_router)


def add_commands(sub, options) -> None:
    """doctor, bench, demo and image (serve comes first in the help: add_serve_command)."""
    p = sub.add_parser("doctor", parents=[options], help="check this host: engines, kernel features, disk")
    p.add_argument("--data-dir", help="the data directory to check (default: $FORKD_DATA_DIR or ~/.local/share/forkd)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("bench", parents=[options], help="latency probe through the server: spawn, exec, branch, fan-out")
    p.add_argument("--n", type=int, default=5, help="fan-out size (default 5)")
    p.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", help="snapshot, fork 10 children, branch a busy child, fork grandchildren "
                                       "(in-process: needs no server)")
    demo.add_argument("--data-dir", help="state directory (default: a temporary one, removed afterwards)")
    demo.add_argument("--children", type=int, default=10)
    demo.add_argument("--grandchildren", type=int, default=3)
    demo.add_argument("--mib", type=int, default=200, help="size of the array the snapshot holds")
    demo.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    add_debug_option(demo)
    demo.set_defaults(func=cmd_demo)

    image = sub.add_parser("image", help="the VM engine's guest image").add_subparsers(dest="image_command",
                                                                                      required=True)
    p = image.add_parser("build", help="build (or reuse, when its inputs are unchanged) the guest kernel and "
                                       "initramfs from Debian's packages, cached under the data dir")
    p.add_argument("--data-dir", help="state directory (default: $FORKD_DATA_DIR or ~/.local/share/forkd)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_debug_option(p)
    p.set_defaults(func=cmd_image_build)
