"""The ``forkd`` command line.

Every subcommand except ``serve``, ``doctor`` and ``demo`` talks to a server (``--url`` /
``$FORKD_URL``, token ``--token`` / ``$FORKD_TOKEN``) through the client SDK; tables and progress
bars for people, ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import warnings


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _client(args):
    from .client import Controller

    return Controller(args.url or None, args.token or None, timeout=args.timeout)


def _emit_json(obj) -> None:
    print(json.dumps(obj, indent=None if not sys.stdout.isatty() else 2))


def _ago(ts) -> str:
    if not ts:
        return "-"
    secs = max(0, int(time.time() - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"


def _table(title: str, columns: list[str], rows: list[list]):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, overflow="fold", no_wrap=i == 0)  # ids and tags stay whole
    for row in rows:
        table.add_row(*[("-" if v is None else str(v)) for v in row])
    return table


def _progress(total: int, description: str, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=_console(stderr=True), transient=True, disable=not enabled)
    return progress, description, total


# --- server commands ----------------------------------------------------------------------------

def cmd_serve(args) -> int:
    from .serve import serve

    return serve(host=args.host, port=args.port, data_dir=args.data_dir, token_file=args.token_file,
                 tls_cert=args.tls_cert, tls_key=args.tls_key, no_token=args.no_token,
                 branch_concurrency=args.branch_concurrency, extra_args=args.jupyter_args)


def _pause(info: dict) -> str | None:
    """The precise pause when the server gives it (pause_us), else forkd's integer pause_ms."""
    if info.get("pause_us") is not None:
        return f"{info['pause_us'] / 1000:.2f} ms"
    return None if info.get("pause_ms") is None else f"{info['pause_ms']} ms"


def _snapshot_rows(snaps: list[dict]) -> list[list]:
    return [[s["tag"], s.get("status", "ready"), s.get("engine", "-"), s.get("branched_from"), _pause(s),
             _ago(s.get("created_at_unix")), s.get("warning")] for s in snaps]


def _print_snapshot(args, info: dict) -> int:
    if args.json:
        _emit_json(info)
    else:
        _console().print(_table("snapshot", ["tag", "status", "engine", "branched from", "pause", "created",
                                             "warning"], _snapshot_rows([info])))
    return 0


def cmd_snapshot(args) -> int:
    ctl = _client(args)
    if args.from_sandbox:
        if args.setup or args.setup_file or args.setup_command or args.kernel or args.rootfs or args.package \
                or args.disk_mib:
            raise SystemExit("forkd snapshot: --from-sandbox branches a running sandbox; it takes no "
                             "--setup/--setup-file/--setup-command/--package/--disk-mib/--kernel/--rootfs")
        mode = "live" if args.live else "diff" if args.diff else None
        with _console(stderr=True).status(f"branching {args.from_sandbox}", spinner="dots") if not args.json \
                else _nullcontext():
            from .client import ForkWarning

            with warnings.catch_warnings():  # said below, in the CLI's own words
                warnings.simplefilter("ignore", ForkWarning)
                info = ctl.branch_sandbox(args.from_sandbox, args.tag, mode=mode, wait=not args.no_wait,
                                          lossy=args.lossy)
        if info.get("warnings") and not args.json:
            console = _console(stderr=True)
            console.print(f"[yellow]warning:[/yellow] branch {info['tag']} did not carry (--lossy):")
            for item in info["warnings"]:
                console.print(f"  - {item}", markup=False, highlight=False)
    else:
        if not args.tag:
            raise SystemExit("forkd snapshot: --tag is required (or --from-sandbox ID to branch a sandbox)")
        if args.diff or args.live or args.no_wait:
            raise SystemExit("forkd snapshot: --diff, --live and --no-wait need --from-sandbox")
        if args.kernel or args.rootfs:
            body = {"tag": args.tag, "kernel": args.kernel, "rootfs": args.rootfs,
                    "boot_wait_secs": args.boot_wait_secs}
            if args.mem_size_mib:
                body["mem_size_mib"] = args.mem_size_mib
            info = ctl._request("POST", "/v1/snapshots", {k: v for k, v in body.items() if v is not None},
                                timeout=900)
        else:
            setup = args.setup
            if args.setup_file:
                with open(args.setup_file) as f:
                    setup = f.read()
            commands = [shlex.split(c) for c in args.setup_command or []]
            with _console(stderr=True).status(f"building snapshot {args.tag}", spinner="dots") if not args.json \
                    else _nullcontext():
                info = ctl.create_snapshot(args.tag, setup=setup, setup_commands=commands or None,
                                           engine=args.engine, mem_size_mib=args.mem_size_mib,
                                           disk_mib=args.disk_mib, packages=args.package, lossy=args.lossy)
    return _print_snapshot(args, info)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cmd_spawn(args) -> int:
    ctl = _client(args)
    options = {k: True for k in ("per_child_netns", "prewarm", "live_fork", "hugepages") if getattr(args, k)}
    t0 = time.perf_counter()
    with _console(stderr=True).status(f"forking {args.n} from {args.tag}", spinner="dots") if not args.json \
            else _nullcontext():
        kids = ctl.spawn_sandboxes(args.tag, args.n, memory_limit_mib=args.memory_limit_mib, **options)
    total_ms = (time.perf_counter() - t0) * 1000
    if args.json:
        _emit_json(kids)
        return 0
    console = _console()
    console.print(_table(f"{len(kids)} sandbox(es) from {args.tag}", ["id", "pid", "engine", "snapshot"],
                         [[k["id"], k.get("pid"), k.get("engine"), k["snapshot_tag"]] for k in kids]))
    console.print(f"spawn: {total_ms:.1f} ms for {len(kids)} ({total_ms / max(1, len(kids)):.2f} ms each, "
                  f"round trip included)")
    return 0


def cmd_ls(args) -> int:
    ctl = _client(args)
    if args.snapshots:
        snaps = ctl.list_snapshots()
        if args.json:
            _emit_json(snaps)
        else:
            _console().print(_table(f"{len(snaps)} snapshot(s)", ["tag", "status", "engine", "branched from",
                                                                  "pause", "created", "warning"],
                                    _snapshot_rows(snaps)))
        return 0
    boxes = ctl.list_sandboxes()
    if args.json:
        _emit_json(boxes)
    else:
        _console().print(_table(f"{len(boxes)} sandbox(es)", ["id", "snapshot", "engine", "pid", "branches",
                                                              "memory limit", "created"],
                                [[b["id"], b["snapshot_tag"], b.get("engine"), b.get("pid"), b.get("branch_count"),
                                  b.get("memory_limit_mib"), _ago(b.get("created_at_unix"))] for b in boxes]))
    return 0


def cmd_kill(args) -> int:
    from .client import ControllerError

    ctl = _client(args)
    if bool(args.ids) + bool(args.all) + bool(args.tag) != 1:
        raise SystemExit("forkd kill: give sandbox IDS, or --all, or --tag TAG (exactly one)")
    ids = args.ids
    if args.all or args.tag:
        ids = [b["id"] for b in ctl.list_sandboxes() if args.all or b["snapshot_tag"] == args.tag]
    killed, failed = [], {}
    progress, desc, total = _progress(len(ids), "killing", enabled=not args.json and len(ids) > 1)
    with progress:
        task = progress.add_task(desc, total=total)
        for sid in ids:
            try:
                ctl.kill_sandbox(sid)
                killed.append(sid)
            except ControllerError as exc:
                failed[sid] = exc.message
            progress.advance(task)
    if args.json:
        _emit_json({"killed": killed, "failed": failed})
    else:
        console = _console()
        console.print(f"killed {len(killed)} sandbox(es)" + (f": {', '.join(killed)}" if len(killed) <= 5 else ""))
        for sid, why in failed.items():
            console.print(f"[red]{sid}: {why}[/]")
    return 1 if failed else 0


def cmd_exec(args) -> int:
    ctl = _client(args)
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        raise SystemExit("forkd exec: give a command after the sandbox id, e.g. forkd exec ID -- ls -l")
    reply = ctl.exec_command(args.id, argv, args.timeout_secs)
    if args.json:
        _emit_json(reply)
    else:
        sys.stdout.write(reply.get("stdout", ""))
        sys.stderr.write(reply.get("stderr", ""))
        if reply.get("error"):
            sys.stderr.write(f"forkd exec: {reply['error']}\n")
    return int(reply.get("exit_code", 1)) & 0xFF


def cmd_eval(args) -> int:
    reply = _client(args).eval_code(args.id, args.code)
    if args.json:
        _emit_json(reply)
    elif reply.get("error"):
        print(reply["error"], file=sys.stderr)
    else:
        print(reply.get("result"))
    return 0 if not reply.get("error") else 1


def cmd_run(args) -> int:
    code = sys.stdin.read() if args.code == "-" else args.code
    reply = _client(args).run_code(args.id, code)
    if args.json:
        _emit_json(reply)
        return 0 if not reply.get("error") else 1
    sys.stdout.write(reply.get("stdout", ""))
    sys.stderr.write(reply.get("stderr", ""))
    if reply.get("result"):
        print(reply["result"].get("text/plain", ""))
    if reply.get("error"):
        sys.stderr.write("".join(reply["error"].get("traceback") or [f"{reply['error']['ename']}: "
                                                                       f"{reply['error']['evalue']}\n"]))
        return 1
    return 0


def cmd_ping(args) -> int:
    t0 = time.perf_counter()
    reply = _client(args).ping_sandbox(args.id)
    ms = (time.perf_counter() - t0) * 1000
    if args.json:
        _emit_json(reply)
    else:
        print(f"pong from {args.id} in {ms:.1f} ms (pid {reply.get('pid')} inside, python {reply.get('python')})")
    return 0


def cmd_rmi(args) -> int:
    from .client import ControllerError

    if args.cascade and args.force:
        raise SystemExit("forkd rmi: --cascade and --force are mutually exclusive")
    ctl = _client(args)
    removed, failed = [], {}
    for tag in args.tags:
        try:
            ctl.delete_snapshot(tag, cascade=args.cascade, force=args.force)
            removed.append(tag)
        except ControllerError as exc:
            failed[tag] = exc.message
    if args.json:
        _emit_json({"removed": removed, "failed": failed})
    else:
        console = _console()
        for tag in removed:
            console.print(f"removed {tag}")
        for tag, why in failed.items():
            console.print(f"[red]{tag}: {why}[/]")
    return 1 if failed else 0


def cmd_snapshot_info(args) -> int:
    info = _client(args).snapshot_info(args.tag)
    if args.json:
        _emit_json(info)
        return 0
    rows = [[k, json.dumps(v) if isinstance(v, (list, dict)) else v] for k, v in info.items()]
    _console().print(_table(f"snapshot {args.tag}", ["field", "value"], rows))
    return 0


def cmd_snapshot_compact(args) -> int:
    ctl = _client(args)
    with _console(stderr=True).status(f"compacting {args.source} into {args.to}", spinner="dots") if not args.json \
            else _nullcontext():
        info = ctl.compact_snapshot(args.source, args.to)
    return _print_snapshot(args, info)


def _workspace_rows(workspaces: list[dict]) -> list[list]:
    return [[w["name"], w["status"], w.get("live_sandbox_id"), w.get("current_state_tag"),
             w["source_snapshot_tag"], _ago(w.get("last_active_unix"))] for w in workspaces]


# The id (ws- and its first sandbox's id) is in --json; a table for people fits 80 columns without it.
WORKSPACE_COLUMNS = ["name", "status", "sandbox", "state", "source", "active"]


def cmd_workspace(args) -> int:
    ctl = _client(args)
    action = args.workspace_action
    if action == "list":
        workspaces = ctl.list_workspaces()
        if args.json:
            _emit_json(workspaces)
        else:
            _console().print(_table(f"{len(workspaces)} workspace(s)", WORKSPACE_COLUMNS, _workspace_rows(workspaces)))
        return 0
    if action == "delete":
        ctl.delete_workspace(args.name)
        if args.json:
            _emit_json({"deleted": args.name})
        else:
            _console().print(f"deleted workspace {args.name} (its sandbox and its state snapshot)")
        return 0
    busy = {"create": f"creating workspace {args.name}", "suspend": f"suspending {args.name}",
            "resume": f"resuming {args.name}"}[action]
    with _console(stderr=True).status(busy, spinner="dots") if not args.json else _nullcontext():
        if action == "create":
            info = ctl.create_workspace(args.name, args.snapshot, memory_limit_mib=args.memory_limit_mib)
        elif action == "suspend":
            info = ctl.suspend_workspace(args.name, diff=args.diff)
        else:
            info = ctl.resume_workspace(args.name)
    if args.json:
        _emit_json(info)
    else:
        _console().print(_table("workspace", WORKSPACE_COLUMNS, _workspace_rows([info])))
    return 0


def add_workspace_command(sub, client) -> None:
    ws = sub.add_parser("workspace", help="named sandboxes that suspend into a snapshot and resume from it")
    wsub = ws.add_subparsers(dest="workspace_command", required=True, metavar="ACTION")
    p = wsub.add_parser("create", parents=[client], help="start a workspace from a snapshot")
    p.add_argument("name", help="the workspace's name (its state snapshot is ws-NAME-state)")
    p.add_argument("--snapshot", "-t", required=True, metavar="TAG", help="the snapshot to start from")
    p.add_argument("--memory-limit-mib", type=int, help="memory limit of its sandbox, kept across resumes")
    p.add_argument("--per-child-netns", action="store_true", help="forkd VM option (accepted and ignored)")
    p.set_defaults(workspace_action="create")
    p = wsub.add_parser("suspend", parents=[client], help="snapshot the workspace into ws-NAME-state, stop its sandbox")
    p.add_argument("name")
    p.add_argument("--diff", action="store_true", help="diff branch instead of full")
    p.set_defaults(workspace_action="suspend")
    p = wsub.add_parser("resume", parents=[client], help="start the workspace again from its state")
    p.add_argument("name")
    p.set_defaults(workspace_action="resume")
    p = wsub.add_parser("list", aliases=["ls"], parents=[client], help="list workspaces")
    p.set_defaults(workspace_action="list")
    p = wsub.add_parser("delete", aliases=["rm"], parents=[client],
                        help="kill the workspace's sandbox and delete its state snapshot")
    p.add_argument("name")
    p.set_defaults(workspace_action="delete")
    ws.set_defaults(func=cmd_workspace)


def cmd_doctor(args) -> int:
    from .doctor import run_checks

    from .controller import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    rows = run_checks(data_dir, url=args.url or os.environ.get("FORKD_URL"), token=args.token)
    if args.json:
        _emit_json(rows)
    else:
        colour = {"ok": "green", "warn": "yellow", "fail": "red", "info": "cyan"}
        from rich.table import Table

        table = Table(title="forkd doctor", title_justify="left")
        for col in ("check", "status", "detail", "fix"):
            table.add_column(col, overflow="fold")
        for r in rows:
            c = colour.get(r["status"], "white")
            table.add_row(r["check"], f"[{c}]{r['status']}[/]", r["detail"], r.get("fix") or "")
        _console().print(table)
    return 1 if any(r["status"] == "fail" and r.get("required") for r in rows) else 0


def cmd_bench(args) -> int:
    from .bench import run_bench

    figures = run_bench(_client(args), n=args.n, show=not args.json)
    if args.json:
        _emit_json(figures)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    figures = run_demo(data_dir=args.data_dir, children=args.children, grandchildren=args.grandchildren,
                       mib=args.mib)
    if args.json:
        print(json.dumps(figures))
    checks = ("source_result_unchanged", "state_carried_to_grandchildren", "children_random_streams_distinct")
    return 0 if all(figures[c] for c in checks) else 1


def cmd_image_build(args) -> int:
    """Build (or reuse) the VM engine's guest image under the data dir: kernel + initramfs."""
    import time

    from forkd_engine.vm.image import ImageError, build_image

    from .controller import default_data_dir

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


def add_image_command(sub) -> None:
    image = sub.add_parser("image", help="the VM engine's guest image").add_subparsers(dest="image_command",
                                                                                      required=True)
    p = image.add_parser("build", help="build (or reuse, when its inputs are unchanged) the guest kernel and "
                                       "initramfs from Debian's packages, cached under the data dir")
    p.add_argument("--data-dir", help="state directory (default: $FORKD_DATA_DIR or ~/.local/share/forkd)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_image_build)


# --- the parser ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forkd", description="Fork-on-write Python sandboxes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", "--daemon-url", dest="url", default=os.environ.get("FORKD_URL"),
                        help="the server (default: $FORKD_URL, a running server found on this host, "
                             "else http://127.0.0.1:8889)")
    client.add_argument("--token", "--daemon-token", dest="token", default=None,
                        help="bearer token (default: $FORKD_TOKEN)")
    client.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout in seconds (default 60)")
    client.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")

    p = sub.add_parser("serve", help="run the API server (a standalone jupyter-server) on 127.0.0.1:8889")
    p.add_argument("--host", default=os.environ.get("FORKD_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("FORKD_PORT", "8889")))
    p.add_argument("--data-dir", default=os.environ.get("FORKD_DATA_DIR"),
                   help="state directory (default: $FORKD_DATA_DIR or ~/.local/share/forkd)")
    p.add_argument("--token-file", default=os.environ.get("FORKD_TOKEN_FILE"),
                   help="file holding the bearer token (16+ bytes); default: generate one and print it once")
    p.add_argument("--no-token", action="store_true", help="no authentication (loopback addresses only)")
    p.add_argument("--tls-cert", default=os.environ.get("FORKD_TLS_CERT"))
    p.add_argument("--tls-key", default=os.environ.get("FORKD_TLS_KEY"))
    p.add_argument("--branch-concurrency", type=int, default=None,
                   help="branches in flight at once (default 4)")
    p.set_defaults(func=cmd_serve, jupyter_args=[])
    p.epilog = "Other jupyter-server options pass through, e.g. --ServerApp.log_level=DEBUG."

    p = sub.add_parser("snapshot", parents=[client], help="create a snapshot, or branch a sandbox with --from-sandbox")
    p.add_argument("--tag", help="the snapshot's tag (optional with --from-sandbox)")
    p.add_argument("--setup", help="Python code run in the interpreter before it is frozen")
    p.add_argument("--setup-file", help="a file of Python code to run before freezing")
    p.add_argument("--setup-command", action="append", metavar="CMD",
                   help="a command run first, e.g. 'pip install numpy' (repeatable)")
    p.add_argument("--engine", default="auto", choices=("auto", "process", "vm"))
    p.add_argument("--mem-size-mib", type=int)
    p.add_argument("--disk-mib", type=int, help="VM engine: an ext4 data disk of this size at /data")
    p.add_argument("--package", action="append", metavar="DEB",
                   help="VM engine: a Debian package for the guest, e.g. python3-numpy (repeatable)")
    p.add_argument("--kernel", help="forkd's form: a guest kernel (selects the VM engine)")
    p.add_argument("--rootfs", help="forkd's form: a root filesystem image")
    p.add_argument("--boot-wait-secs", type=int)
    p.add_argument("--from-sandbox", metavar="ID", help="branch this running sandbox into a new snapshot")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--diff", action="store_true", help="diff branch")
    modes.add_argument("--live", action="store_true", help="live branch (shortest pause)")
    p.add_argument("--no-wait", action="store_true", help="with --live: return while memory is still written")
    p.add_argument("--lossy", action="store_true",
                   help="fork even if running work (threads, child processes) stays behind: in a branch "
                        "(--from-sandbox; the snapshot lists it as warnings) or left by --setup")
    p.set_defaults(func=cmd_snapshot)

    for name, helptext in (("spawn", "fork N sandboxes from a snapshot"), ("fork", "same as spawn")):
        p = sub.add_parser(name, parents=[client], help=helptext)
        p.add_argument("--tag", "-t", required=True, help="the snapshot to fork from")
        p.add_argument("-n", type=int, default=1, help="how many sandboxes (1-1000)")
        p.add_argument("--memory-limit-mib", type=int)
        for flag in ("--per-child-netns", "--prewarm", "--live-fork", "--hugepages"):
            p.add_argument(flag, action="store_true", help="forkd VM option (accepted; the process engine ignores it)")
        p.set_defaults(func=cmd_spawn)

    p = sub.add_parser("ls", parents=[client], help="list sandboxes (or snapshots with --snapshots)")
    p.add_argument("--snapshots", "-s", action="store_true", help="list snapshots instead")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("kill", parents=[client], help="kill sandboxes: IDS, --all, or --tag T")
    p.add_argument("ids", nargs="*")
    p.add_argument("--all", action="store_true")
    p.add_argument("--tag", help="every sandbox forked from this snapshot")
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("exec", parents=[client], help="run a command in a sandbox: forkd exec ID -- CMD...")
    p.add_argument("id")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.add_argument("--timeout-secs", type=float, default=30)
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("eval", parents=[client], help="evaluate a Python expression in a sandbox")
    p.add_argument("id")
    p.add_argument("code")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("run", parents=[client], help="run Python statements like a notebook cell ('-' reads stdin)")
    p.add_argument("id")
    p.add_argument("code")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("ping", parents=[client], help="round trip to a sandbox's agent")
    p.add_argument("id")
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser("rmi", parents=[client], help="delete snapshots")
    p.add_argument("tags", nargs="+")
    p.add_argument("--cascade", action="store_true", help="also delete snapshots branched from it")
    p.add_argument("--force", action="store_true", help="delete even if others were branched from it")
    p.set_defaults(func=cmd_rmi)

    p = sub.add_parser("snapshot-info", parents=[client], help="details of one snapshot")
    p.add_argument("tag")
    p.set_defaults(func=cmd_snapshot_info)

    p = sub.add_parser("snapshot-compact", parents=[client],
                       help="copy a snapshot into an independent one (branched_from compact:TAG)")
    p.add_argument("--from", dest="source", required=True, metavar="TAG", help="the snapshot to copy")
    p.add_argument("--to", required=True, metavar="TAG", help="the new snapshot's tag")
    p.set_defaults(func=cmd_snapshot_compact)

    add_workspace_command(sub, client)

    p = sub.add_parser("doctor", parents=[client], help="check this host: engines, kernel features, disk")
    p.add_argument("--data-dir", help="the data directory to check (default: $FORKD_DATA_DIR or ~/.local/share/forkd)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("bench", parents=[client], help="latency probe through the server: spawn, exec, branch, fan-out")
    p.add_argument("--n", type=int, default=5, help="fan-out size (default 5)")
    p.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", help="snapshot, fork 10 children, branch a busy child, fork grandchildren "
                                       "(in-process: needs no server)")
    demo.add_argument("--data-dir", help="state directory (default: a temporary one, removed afterwards)")
    demo.add_argument("--children", type=int, default=10)
    demo.add_argument("--grandchildren", type=int, default=3)
    demo.add_argument("--mib", type=int, default=200, help="size of the array the snapshot holds")
    demo.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    demo.set_defaults(func=cmd_demo)
    add_image_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .client import ControllerError, ServerUnreachable

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "serve" or not all(a.startswith(("--ServerApp.", "--ForkdApp.", "--IdentityProvider."))
                                               for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.jupyter_args = extra
    try:
        return args.func(args)
    except ServerUnreachable as exc:
        print(f"forkd: {exc}", file=sys.stderr)
        return 2
    except ControllerError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"status": exc.status, "error": exc.message}))
        print(f"forkd {args.command}: {exc.message} (HTTP {exc.status})", file=sys.stderr)
        if exc.status == 401:
            print("forkd: set FORKD_TOKEN (or --token) to the server's token", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
