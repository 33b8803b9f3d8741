"""``forkd spawn``/``fork``, ``promote``, ``ls``, ``kill``, ``exec``, ``eval``, ``run``, ``ping``: sandboxes.

``forkd fork --tag T`` is forkd's (the same as spawn); ``forkd fork SANDBOX -n N`` makes a fork tree of
a running sandbox, and ``forkd promote`` keeps its winner."""

from __future__ import annotations

import argparse
import sys
import time

from ..client import memory_limit_arg
from ._errors import item_failed
from ._output import (add_label_option, ago, busy, client, console, emit_json, labels_arg, progress, say_unlisted,
                      table)
from ._snapshots import SNAPSHOT_COLUMNS, snapshot_rows


def cmd_spawn(args) -> int:
    ctl = client(args)
    options = {k: True for k in ("per_child_netns", "prewarm", "live_fork", "hugepages") if getattr(args, k)}
    labels = labels_arg(args.label, args.command)
    t0 = time.perf_counter()
    with busy(args, f"forking {args.n} from {args.tag}"):
        kids = ctl.spawn_sandboxes(args.tag, args.n, memory_limit_mib=args.memory_limit_mib, labels=labels, **options)
    total_ms = (time.perf_counter() - t0) * 1000
    if args.json:
        emit_json(kids)
        return 0
    out = console()
    out.print(table(f"{len(kids)} sandbox(es) from {args.tag}", ["id", "pid", "engine", "snapshot"],
                    [[k["id"], k.get("pid"), k.get("engine"), k["snapshot_tag"]] for k in kids]))
    out.print(f"spawn: {total_ms:.1f} ms for {len(kids)} ({total_ms / max(1, len(kids)):.2f} ms each, "
              f"round trip included)")
    return 0


def cmd_fork(args) -> int:
    if (args.sandbox is None) == (args.tag is None):
        raise SystemExit("forkd fork: give a SANDBOX to fork (a fork tree), or --tag SNAPSHOT to spawn from (one of them)")
    if args.tag is not None:
        if args.branch_tag is not None or args.lossy:
            raise SystemExit("forkd fork: --branch-tag and --lossy are for forking a SANDBOX, not a snapshot")
        return cmd_spawn(args)
    for flag in ("per_child_netns", "prewarm", "live_fork", "hugepages"):
        if getattr(args, flag):
            raise SystemExit(f"forkd fork: --{flag.replace('_', '-')} is for spawning from a snapshot (--tag)")
    from ..client import ControllerError

    ctl = client(args)
    try:
        with busy(args, f"forking {args.sandbox} into {args.n}"):
            tree = ctl.fork_sandbox(args.sandbox, args.n, tag=args.branch_tag, labels=labels_arg(args.label, "fork"),
                                    memory_limit_mib=args.memory_limit_mib, lossy=args.lossy)
    except ControllerError as exc:  # the wire's name for -n is `count`
        if said := exc.about_field("count"):
            raise SystemExit(f"forkd fork: -n {said}") from None
        raise
    if args.json:
        emit_json(tree)
        return 0
    kids, snap = tree["sandboxes"], tree["snapshot"]
    out = console()
    out.print(table(f"fork tree {tree['fork_tree_id']}: {len(kids)} sandbox(es) of {args.sandbox} (branch "
                    f"{snap['tag']}, paused it {snap.get('pause_ms', '?')} ms)", ["id", "pid", "engine"],
                    [[k["id"], k.get("pid"), k.get("engine")] for k in kids]))
    out.print(f"keep one and drop the rest: forkd promote {kids[0]['id']}")
    return 0


def cmd_promote(args) -> int:
    ctl = client(args)
    with busy(args, f"promoting {args.sandbox}"):
        result = ctl.promote_sandbox(args.sandbox, args.tree, cleanup_siblings=not args.keep_siblings)
    if args.json:
        emit_json(result)
        return 1 if result["failed"] else 0
    out = console()
    killed, released = result["killed"], result["released"]
    out.print(f"{args.sandbox} won fork tree {result['fork_tree_id']}: killed {len(killed)} sibling(s)"
              + (f", released snapshot {', '.join(released)}" if released else ""))
    for kept in result["kept"]:
        out.print(f"kept {kept['kind']} {kept['id']}: {kept['reason']}")
    for failed in result["failed"]:
        print(f"forkd promote: could not kill {failed['id']}: {failed['error']}; forkd kill {failed['id']}",
              file=sys.stderr)
    return 1 if result["failed"] else 0


def cmd_ls(args) -> int:
    ctl = client(args)
    labels = labels_arg(args.label, "ls")
    if args.snapshots:
        snaps = ctl.list_snapshots(labels=labels)
        say_unlisted("ls", snaps)
        if args.json:
            emit_json(snaps)
        else:
            rows = snapshot_rows(snaps)
            fleet = any("host" in s for s in snaps)  # a router's listing: which hosts hold each
            if fleet:
                rows = [row + [", ".join(s.get("hosts") or [s.get("host") or "-"])] for row, s in zip(rows, snaps)]
            console().print(table(f"{len(snaps)} snapshot(s)", SNAPSHOT_COLUMNS + ["host"] * fleet, rows))
        return 0
    boxes = ctl.list_sandboxes(labels=labels)
    say_unlisted("ls", boxes)
    if args.json:
        emit_json(boxes)
    else:
        fleet = any("host" in b for b in boxes)  # a router's listing: each sandbox's host
        console().print(table(f"{len(boxes)} sandbox(es)", ["id", "snapshot", "engine", "tier", "pid", "branches",
                                                            "memory limit", "created"] + ["status", "host"] * fleet,
                              [[b["id"], b["snapshot_tag"], b.get("engine"), b.get("tier", "running"), b.get("pid"),
                                b.get("branch_count"), b.get("memory_limit_mib"), ago(b.get("created_at_unix"))]
                               + [b.get("status"), b.get("host")] * fleet for b in boxes]))
    return 0


def cmd_kill(args) -> int:
    from ..client import ControllerError

    ctl = client(args)
    if bool(args.ids) + bool(args.all) + bool(args.tag) != 1:
        raise SystemExit("forkd kill: give sandbox IDS, or --all, or --tag TAG (exactly one)")
    ids = args.ids
    if args.all or args.tag:
        listed = ctl.list_sandboxes()
        say_unlisted("kill", listed, outcome="is not killed: run this again when it answers")
        ids = [b["id"] for b in listed if args.all or b["snapshot_tag"] == args.tag]
    killed, failed = [], {}
    bar, desc, total = progress(len(ids), "killing", enabled=not args.json and len(ids) > 1)
    with bar:
        task = bar.add_task(desc, total=total)
        for sid in ids:
            try:
                ctl.kill_sandbox(sid, reason=args.reason)
                killed.append(sid)
            except ControllerError as exc:
                failed[sid] = exc
            bar.advance(task)
    if args.json:
        emit_json({"killed": killed, "failed": {sid: exc.what for sid, exc in failed.items()}})
    else:
        listed = f": {', '.join(killed)}" if 0 < len(killed) <= 5 else ""
        console().print(f"killed {len(killed)} sandbox(es){listed}")
        for sid, exc in failed.items():
            item_failed("kill", sid, exc)
    return 1 if failed else 0


def cmd_exec(args) -> int:
    argv = args.argv
    if "--" in argv:  # options between the id and "--" are exec's own (ID --timeout-secs 5 -- cmd), not the command
        split = argv.index("--")
        if split:
            args.exec_parser.parse_args([*argv[:split], args.id], namespace=args)
        argv = argv[split + 1:]
    if not argv:
        raise SystemExit("forkd exec: give a command after the sandbox id, e.g. forkd exec ID -- ls -l")
    reply = client(args).exec_command(args.id, argv, args.timeout_secs)
    if args.json:
        emit_json(reply)
    else:
        sys.stdout.write(reply.get("stdout", ""))
        sys.stderr.write(reply.get("stderr", ""))
        if reply.get("error"):
            sys.stderr.write(f"forkd exec: {_exec_failure(reply['error'], argv, args.timeout_secs)}\n")
    return int(reply.get("exit_code", 1)) & 0xFF


def _exec_failure(error: str, argv: list[str], timeout: float) -> str:
    """The agent's failure (``<Type>: <message>``, as forkd words it) with what to do about it."""
    if error.startswith("FileNotFoundError:"):
        return (f"{argv[0]}: no such command in the sandbox ({error}); give its full path, or run it through a "
                f"shell: forkd exec ID -- sh -c '...'")
    if error.startswith("PermissionError:"):
        return f"{argv[0]}: cannot be run in the sandbox ({error}); is it an executable file?"
    if error.startswith("TimeoutExpired:"):
        return f"{error}; give it longer with --timeout-secs (it was {timeout:g} s)"
    return error


def cmd_eval(args) -> int:
    reply = client(args).eval_code(args.id, args.code)
    if args.json:
        emit_json(reply)
    elif reply.get("error"):
        hint = ("; eval takes one expression: run statements with forkd run ID CODE"
                if reply["error"].startswith("SyntaxError:") and "(<eval>" in reply["error"] else "")
        print(reply["error"] + hint, file=sys.stderr)
    else:
        print(reply.get("result"))
    return 0 if not reply.get("error") else 1


def cmd_run(args) -> int:
    code = sys.stdin.read() if args.code == "-" else args.code
    reply = client(args).run_code(args.id, code)
    if args.json:
        emit_json(reply)
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
    reply = client(args).ping_sandbox(args.id)
    ms = (time.perf_counter() - t0) * 1000
    if args.json:
        emit_json(reply)
    else:
        print(f"pong from {args.id} in {ms:.1f} ms (pid {reply.get('pid')} inside, python {reply.get('python')})")
    return 0


def add_commands(sub, options) -> None:
    for name, helptext in (("spawn", "fork N sandboxes from a snapshot"),
                           ("fork", "fork a running SANDBOX into N copies (a fork tree; forkd promote keeps one), "
                                    "or, with --tag, the same as spawn")):
        p = sub.add_parser(name, parents=[options], help=helptext, description=helptext)
        if name == "fork":
            p.add_argument("sandbox", nargs="?", help="the running sandbox to fork (branched once, N children)")
        p.add_argument("--tag", "-t", required=name == "spawn", help="the snapshot to fork from")
        p.add_argument("-n", type=int, default=1, help="how many sandboxes (1-1000)")
        p.add_argument("--memory-limit-mib", type=memory_limit_arg, metavar="MIB|host",
                       help="memory limit of each sandbox (host: all of its host's memory)")
        add_label_option(p, "each sandbox carries, besides the snapshot's")
        for flag in ("--per-child-netns", "--prewarm", "--live-fork", "--hugepages"):
            p.add_argument(flag, action="store_true", help="forkd VM option (accepted; the process engine ignores it)")
        if name == "fork":
            p.add_argument("--branch-tag", help="the tag of the tree's branch (default: the tree's id); a tag you "
                                                "give is never released by promote")
            p.add_argument("--lossy", action="store_true", help="fork even if running work (threads, child "
                                                                "processes) stays behind; the branch lists it")
        p.set_defaults(func=cmd_fork if name == "fork" else cmd_spawn)

    p = sub.add_parser("promote", parents=[options], help="keep the winner of a fork tree: its siblings are killed, "
                                                          "the tree's snapshot released if nothing needs it")
    p.add_argument("sandbox", help="the winner (a child of forkd fork SANDBOX -n N)")
    p.add_argument("--tree", default=None, help="the fork tree (default: the one the sandbox is in)")
    p.add_argument("--keep-siblings", action="store_true", help="leave the siblings running; only close the tree")
    p.set_defaults(func=cmd_promote)

    p = sub.add_parser("ls", parents=[options], help="list sandboxes (or snapshots with --snapshots)")
    p.add_argument("--snapshots", "-s", action="store_true", help="list snapshots instead")
    add_label_option(p, "that what is listed carries (all of them must match)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("kill", parents=[options], help="kill sandboxes: IDS, --all, or --tag T")
    p.add_argument("ids", nargs="*")
    p.add_argument("--all", action="store_true")
    p.add_argument("--tag", help="every sandbox forked from this snapshot")
    p.add_argument("--reason", help="why, one line: what a later call about the sandbox says (its 404)")
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("exec", parents=[options], help="run a command in a sandbox: forkd exec ID -- CMD...")
    p.add_argument("id")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="command")  # not "command": that names the subcommand
    p.add_argument("--timeout-secs", type=float, default=30)
    p.set_defaults(func=cmd_exec, exec_parser=p)

    p = sub.add_parser("eval", parents=[options], help="evaluate a Python expression in a sandbox")
    p.add_argument("id")
    p.add_argument("code")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("run", parents=[options], help="run Python statements like a notebook cell ('-' reads stdin)")
    p.add_argument("id")
    p.add_argument("code")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("ping", parents=[options], help="round trip to a sandbox's agent")
    p.add_argument("id")
    p.set_defaults(func=cmd_ping)
