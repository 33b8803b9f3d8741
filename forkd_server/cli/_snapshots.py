"""``forkd snapshot`` (create, or branch a sandbox), ``rmi``, ``snapshot-info``, ``snapshot-compact``."""

from __future__ import annotations

import json
import shlex
import warnings

from ..client import memory_limit_arg
from ._errors import item_failed
from ._output import add_label_option, ago, busy, client, console, emit_json, labels_arg, table

SNAPSHOT_COLUMNS = ["tag", "status", "engine", "branched from", "pause", "created", "warning"]


def _pause(info: dict) -> str | None:
    """The precise pause when the server gives it (pause_us), else forkd's integer pause_ms."""
    if info.get("pause_us") is not None:
        return f"{info['pause_us'] / 1000:.2f} ms"
    return None if info.get("pause_ms") is None else f"{info['pause_ms']} ms"


def snapshot_rows(snaps: list[dict]) -> list[list]:
    return [[s["tag"], s.get("status", "ready"), s.get("engine", "-"), s.get("branched_from"), _pause(s),
             ago(s.get("created_at_unix")), s.get("warning")] for s in snaps]


def _print_snapshot(args, info: dict) -> int:
    if args.json:
        emit_json(info)
        return 0
    console().print(table("snapshot", SNAPSHOT_COLUMNS, snapshot_rows([info])))
    if info.get("warnings"):  # what a lossy branch or setup did not carry, in the CLI's own words
        err = console(stderr=True)
        err.print(f"[yellow]warning:[/yellow] {info['tag']} did not carry (--lossy):")
        for item in info["warnings"]:
            err.print(f"  - {item}", markup=False, highlight=False)
    return 0


def cmd_snapshot(args) -> int:
    from ..client import ForkWarning

    ctl = client(args)
    labels = labels_arg(args.label, "snapshot")
    with warnings.catch_warnings():  # said by _print_snapshot, in the CLI's own words
        warnings.simplefilter("ignore", ForkWarning)
        if args.from_sandbox:
            given = [flag for flag, value in (
                ("--setup", args.setup), ("--setup-file", args.setup_file), ("--setup-command", args.setup_command),
                ("--package", args.package), ("--disk-mib", args.disk_mib), ("--kernel", args.kernel),
                ("--rootfs", args.rootfs), ("--setup-timeout-secs", args.setup_timeout_secs),
                ("--memory-limit-mib", args.memory_limit_mib)) if value]
            if given:
                raise SystemExit(f"forkd snapshot: --from-sandbox branches a running sandbox; it takes no "
                                 f"{', '.join(given)}")
            mode = "live" if args.live else "diff" if args.diff else None
            with busy(args, f"branching {args.from_sandbox}"):
                info = ctl.branch_sandbox(args.from_sandbox, args.tag, mode=mode, wait=not args.no_wait,
                                          lossy=args.lossy, labels=labels)
            return _print_snapshot(args, info)
        if not args.tag:
            raise SystemExit("forkd snapshot: --tag is required (or --from-sandbox ID to branch a sandbox)")
        if args.diff or args.live or args.no_wait:
            raise SystemExit("forkd snapshot: --diff, --live and --no-wait need --from-sandbox")
        setup = args.setup
        if args.setup_file:
            with open(args.setup_file) as f:
                setup = f.read()
        commands = [shlex.split(c) for c in args.setup_command or []]
        with busy(args, f"building snapshot {args.tag}"):
            info = ctl.create_snapshot(
                args.tag, setup=setup, setup_commands=commands or None, engine=args.engine,
                mem_size_mib=args.mem_size_mib, disk_mib=args.disk_mib, packages=args.package, lossy=args.lossy,
                setup_timeout_secs=args.setup_timeout_secs, memory_limit_mib=args.memory_limit_mib, labels=labels,
                kernel=args.kernel, rootfs=args.rootfs, boot_wait_secs=args.boot_wait_secs)
    return _print_snapshot(args, info)


def cmd_rmi(args) -> int:
    from ..client import ControllerError

    if args.cascade and args.force:
        raise SystemExit("forkd rmi: --cascade and --force are mutually exclusive")
    ctl = client(args)
    removed, failed = [], {}
    for tag in args.tags:
        try:
            ctl.delete_snapshot(tag, cascade=args.cascade, force=args.force)
            removed.append(tag)
        except ControllerError as exc:
            failed[tag] = exc
    if args.json:
        emit_json({"removed": removed, "failed": {tag: exc.what for tag, exc in failed.items()}})
    else:
        out = console()
        for tag in removed:
            out.print(f"removed {tag}")
        for tag, exc in failed.items():
            item_failed("rmi", tag, exc)
    return 1 if failed else 0


def cmd_snapshot_info(args) -> int:
    info = client(args).snapshot_info(args.tag)
    if args.json:
        emit_json(info)
        return 0
    rows = [[k, json.dumps(v) if isinstance(v, (list, dict)) else v] for k, v in info.items()]
    console().print(table(f"snapshot {args.tag}", ["field", "value"], rows))
    return 0


def cmd_snapshot_compact(args) -> int:
    with busy(args, f"compacting {args.source} into {args.to}"):
        info = client(args).compact_snapshot(args.source, args.to)
    return _print_snapshot(args, info)


def cmd_snapshot_share(args) -> int:
    ctl = client(args)
    info = ctl.unshare_snapshot(args.tag) if args.undo else ctl.share_snapshot(args.tag)
    return _print_snapshot(args, info)


def add_commands(sub, options) -> None:
    p = sub.add_parser("snapshot", parents=[options], help="create a snapshot, or branch a sandbox with --from-sandbox")
    p.add_argument("--tag", help="the snapshot's tag (optional with --from-sandbox)")
    p.add_argument("--setup", help="Python code run in the interpreter before it is frozen")
    p.add_argument("--setup-file", help="a file of Python code to run before freezing")
    p.add_argument("--setup-command", action="append", metavar="CMD",
                   help="a command run first, e.g. 'pip install numpy' (repeatable)")
    p.add_argument("--setup-timeout-secs", type=float, metavar="S",
                   help="how long the whole creation may take (default 600)")
    p.add_argument("--memory-limit-mib", type=memory_limit_arg, metavar="MIB|host",
                   help="process engine: the setup's memory limit (default 2048)")
    p.add_argument("--engine", default="auto", choices=("auto", "process", "vm"))
    p.add_argument("--mem-size-mib", type=int)
    p.add_argument("--disk-mib", type=int, help="VM engine: an ext4 data disk of this size at /data")
    p.add_argument("--package", action="append", metavar="DEB",
                   help="VM engine: a Debian package for the guest, e.g. python3-numpy (repeatable)")
    p.add_argument("--kernel", help="forkd's form: a guest kernel (selects the VM engine)")
    p.add_argument("--rootfs", help="forkd's form: a root filesystem image")
    p.add_argument("--boot-wait-secs", type=int)
    add_label_option(p, "the snapshot carries, and its sandboxes and branches inherit")
    p.add_argument("--from-sandbox", metavar="ID", help="branch this running sandbox into a new snapshot")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--diff", action="store_true", help="diff branch")
    modes.add_argument("--live", action="store_true", help="live branch (shortest pause)")
    p.add_argument("--no-wait", action="store_true", help="with --live: return while memory is still written")
    p.add_argument("--lossy", action="store_true",
                   help="fork even if running work (threads, child processes) stays behind: in a branch "
                        "(--from-sandbox) or left by --setup; the snapshot lists it as warnings")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("rmi", parents=[options], help="delete snapshots")
    p.add_argument("tags", nargs="+")
    p.add_argument("--cascade", action="store_true", help="also delete snapshots branched from it")
    p.add_argument("--force", action="store_true", help="delete even if others were branched from it")
    p.set_defaults(func=cmd_rmi)

    p = sub.add_parser("snapshot-info", parents=[options], help="details of one snapshot")
    p.add_argument("tag")
    p.set_defaults(func=cmd_snapshot_info)

    p = sub.add_parser("snapshot-compact", parents=[options],
                       help="copy a snapshot into an independent one (branched_from compact:TAG)")
    p.add_argument("--from", dest="source", required=True, metavar="TAG", help="the snapshot to copy")
    p.add_argument("--to", required=True, metavar="TAG", help="the new snapshot's tag")
    p.set_defaults(func=cmd_snapshot_compact)

    p = sub.add_parser("snapshot-share", parents=[options],
                       help="share a snapshot with every user of a JupyterHub (admins only): all may spawn from it")
    p.add_argument("tag")
    p.add_argument("--undo", action="store_true", help="take the share back")
    p.set_defaults(func=cmd_snapshot_share)
