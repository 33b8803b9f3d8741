"""``forkd workspace create|suspend|resume|list|delete``: named sandboxes that suspend into a
snapshot and resume from it."""

from __future__ import annotations

from ..client import memory_limit_arg
from ._output import ago, busy, client, console, emit_json, table

# The id (ws- and its first sandbox's id) is in --json; a table for people fits 80 columns without it.
WORKSPACE_COLUMNS = ["name", "status", "sandbox", "state", "source", "active"]


def _workspace_rows(workspaces: list[dict]) -> list[list]:
    return [[w["name"], w["status"], w.get("live_sandbox_id"), w.get("current_state_tag"),
             w["source_snapshot_tag"], ago(w.get("last_active_unix"))] for w in workspaces]


def cmd_workspace(args) -> int:
    ctl = client(args)
    action = args.workspace_action
    if action == "list":
        workspaces = ctl.list_workspaces()
        if args.json:
            emit_json(workspaces)
        else:
            console().print(table(f"{len(workspaces)} workspace(s)", WORKSPACE_COLUMNS, _workspace_rows(workspaces)))
        return 0
    if action == "delete":
        ctl.delete_workspace(args.name)
        if args.json:
            emit_json({"deleted": args.name})
        else:
            console().print(f"deleted workspace {args.name} (its sandbox and its state snapshot)")
        return 0
    doing = {"create": f"creating workspace {args.name}", "suspend": f"suspending {args.name}",
             "resume": f"resuming {args.name}"}[action]
    with busy(args, doing):
        if action == "create":
            info = ctl.create_workspace(args.name, args.snapshot, memory_limit_mib=args.memory_limit_mib)
        elif action == "suspend":
            info = ctl.suspend_workspace(args.name, diff=args.diff)
        else:
            info = ctl.resume_workspace(args.name)
    if args.json:
        emit_json(info)
    else:
        console().print(table("workspace", WORKSPACE_COLUMNS, _workspace_rows([info])))
    return 0


def add_commands(sub, options) -> None:
    ws = sub.add_parser("workspace", help="named sandboxes that suspend into a snapshot and resume from it")
    wsub = ws.add_subparsers(dest="workspace_command", required=True, metavar="ACTION")
    p = wsub.add_parser("create", parents=[options], help="start a workspace from a snapshot")
    p.add_argument("name", help="the workspace's name (its state snapshot is ws-NAME-state)")
    p.add_argument("--snapshot", "-t", required=True, metavar="TAG", help="the snapshot to start from")
    p.add_argument("--memory-limit-mib", type=memory_limit_arg, metavar="MIB|host",
                   help="memory limit of its sandbox, kept across resumes (host: all of its host's memory)")
    p.add_argument("--per-child-netns", action="store_true", help="forkd VM option (accepted and ignored)")
    p.set_defaults(workspace_action="create")
    p = wsub.add_parser("suspend", parents=[options], help="snapshot the workspace into ws-NAME-state, stop its sandbox")
    p.add_argument("name")
    p.add_argument("--diff", action="store_true", help="diff branch instead of full")
    p.set_defaults(workspace_action="suspend")
    p = wsub.add_parser("resume", parents=[options], help="start the workspace again from its state")
    p.add_argument("name")
    p.set_defaults(workspace_action="resume")
    p = wsub.add_parser("list", aliases=["ls"], parents=[options], help="list workspaces")
    p.set_defaults(workspace_action="list")
    p = wsub.add_parser("delete", aliases=["rm"], parents=[options],
                        help="kill the workspace's sandbox and delete its state snapshot")
    p.add_argument("name")
    p.set_defaults(workspace_action="delete")
    ws.set_defaults(func=cmd_workspace)
