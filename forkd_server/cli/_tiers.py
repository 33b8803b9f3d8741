"""``forkd freeze ID``, ``forkd store ID``, ``forkd wake ID``: a sandbox's tier by hand (running,
frozen: paused with no CPU, stored: in the store with no process); any call wakes it by itself."""

from __future__ import annotations

from ..client._tiers import tier_said
from ._output import client, console, emit_json


def cmd_tier(args) -> int:
    ctl = client(args)
    move = {"freeze": ctl.freeze_sandbox, "store": ctl.store_sandbox, "wake": ctl.wake_sandbox}[args.command]
    info = move(args.id)
    if args.json:
        emit_json(info)
        return 0
    console().print(tier_said(info), soft_wrap=True)
    return 0


def add_commands(sub, options) -> None:
    for name, helptext in (("freeze", "pause a sandbox: its memory kept, no CPU used; any call wakes it"),
                           ("store", "write a VM sandbox's state to the store and end its process; any call "
                                     "wakes it, same id"),
                           ("wake", "make a frozen or stored sandbox run again now, and say how long it took")):
        p = sub.add_parser(name, parents=[options], help=helptext)
        p.add_argument("id", help="the sandbox")
        p.set_defaults(func=cmd_tier)
