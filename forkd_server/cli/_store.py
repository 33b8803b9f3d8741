"""``forkd push TAG`` and ``forkd pull TAG`` (or ``--digest``): snapshots to and from the server's
remote store, with a progress bar on stderr (none with ``--json``); ``forkd push --delete TAG`` (or a
``sha256:`` digest) deletes one from the store, as ``git push --delete`` does a remote branch."""

from __future__ import annotations

import contextlib

from ._output import client, console, emit_json


@contextlib.contextmanager
def _bar(args, what: str):
    """A progress callback drawing a bar of bytes done on a terminal, else (or with --json) None."""
    err = console(stderr=True)
    if args.json or not err.is_terminal:  # off a terminal the bar would leave an empty line
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def cmd_push(args) -> int:
    if args.delete:
        out = client(args).delete_remote_snapshot(args.tag)
        if args.json:
            emit_json(out)
            return 0
        waiting = out.get("waiting_chunks") or 0
        console().print(f"deleted {args.tag} ({out['digest']}) from {out['store']}\n"
                        f"  {out['removed_chunks']} chunks removed, {out['kept_chunks']} kept (other snapshots list "
                        f"them)" + (f", {waiting} left for now: no snapshot lists them, but they are younger than "
                                    f"the store's grace period (a push may be writing them); a later delete sweeps "
                                    f"them" if waiting else ""), soft_wrap=True)
        return 0
    with _bar(args, f"pushing {args.tag}") as progress:
        out = client(args).push_snapshot(args.tag, progress=progress)
    if args.json:
        emit_json(out)
        return 0
    console().print(f"pushed {args.tag} to {out['store']}: {out['digest']}\n"
                    f"  {out['uploaded_chunks']} of {out['chunks']} chunks uploaded "
                    f"({out['uploaded_bytes'] / 1e6:.1f} MB), the rest were there already", soft_wrap=True)
    return 0


def cmd_pull(args) -> int:
    if (args.tag is None) == (args.digest is None):
        console(stderr=True).print("forkd pull: give a TAG or --digest sha256:... (one of them)")
        return 2
    with _bar(args, f"pulling {args.tag or args.digest[:19]}") as progress:
        info = client(args).pull_snapshot(args.tag, digest=args.digest, progress=progress)
    if args.json:
        emit_json(info)
        return 0
    digest = (info.get("stored") or {}).get("digest")
    figures = info.get("pull")
    if figures is None:  # the same snapshot was here already: nothing moved
        console().print(f"{info['tag']} ({digest}) is already on this server: nothing fetched", soft_wrap=True)
        return 0
    console().print(f"pulled {info['tag']} ({digest}): {info['status']}\n"
                    f"  {figures['fetched_chunks']} of {figures['chunks']} chunks fetched "
                    f"({figures['fetched_bytes'] / 1e6:.1f} MB), the rest were on this server", soft_wrap=True)
    return 0


def add_commands(sub, options) -> None:
    p = sub.add_parser("push", parents=[options], help="push a VM snapshot to the server's remote store (--store)")
    p.add_argument("tag", help="the snapshot (with --delete: its tag in the store, or sha256:DIGEST)")
    p.add_argument("--delete", action="store_true",
                   help="delete it from the remote store instead (chunks other snapshots list stay)")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", parents=[options], help="make a snapshot from the server's remote store")
    p.add_argument("tag", nargs="?", help="the tag in the store (its tag index)")
    p.add_argument("--digest", help="the snapshot's manifest digest, sha256:...")
    p.set_defaults(func=cmd_pull)
