"""``%forkd`` / ``%%forkd``: snapshot, fork, branch, list, kill, exec, tree and run-in-parallel.

Every subcommand talks to the server through the client SDK and returns SDK objects
(``Snapshot``, ``[Sandbox]``, ``CommandResult``...), so ``kids = %forkd fork -t py -n 4`` works.
A server error or a bad argument is one ``UsageError`` line, never a traceback.
"""

from __future__ import annotations

import html

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from forkd_server.client import (CommandResult, Controller, ControllerError, Sandbox, ServerUnreachable,
                                 Snapshot)


__all__ = ["ForkdMagics", "ExecResult", "Listing"]


class ExecResult(CommandResult):
    """A ``CommandResult`` that shows as the command's output (stdout, stderr, exit code)."""

    def _repr_pretty_(self, p, cycle) -> None:
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.error:
            parts.append(f"error: {self.error}")
        if self.exit_code != 0:
            parts.append(f"[exit code {self.exit_code}]")
        p.text("\n".join(parts))


class Listing:
    """What ``%forkd ls`` returns: ``.snapshots`` and ``.sandboxes`` (SDK objects), shown as tables."""

    def __init__(self, snapshots: list[Snapshot], sandboxes: list[Sandbox]):
        self.snapshots, self.sandboxes = snapshots, sandboxes

    def _rows(self):
        snaps = [(s.tag, s.status, s.branched_from or "", "" if s.pause_ms is None else f"{s.pause_ms:.2f} ms")
                 for s in sorted(self.snapshots, key=lambda s: s.tag)]
        sbs = [(b.id, b.snapshot_tag, str(b.info.get("branch_count", 0)))
               for b in sorted(self.sandboxes, key=lambda b: b.id)]
        return snaps, sbs

    @staticmethod
    def _text_table(header, rows) -> list[str]:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return [fmt.format(*header).rstrip()] + [fmt.format(*r).rstrip() for r in rows]

    def _repr_pretty_(self, p, cycle) -> None:
        snaps, sbs = self._rows()
        lines = [f"{len(snaps)} snapshot(s)"]
        if snaps:
            lines += self._text_table(("TAG", "STATUS", "BRANCHED FROM", "PAUSE"), snaps)
        lines.append(f"{len(sbs)} sandbox(es)")
        if sbs:
            lines += self._text_table(("ID", "SNAPSHOT", "BRANCHES"), sbs)
        p.text("\n".join(lines))

    def _repr_html_(self) -> str:
        snaps, sbs = self._rows()

        def table(header, rows):
            head = "".join(f"<th>{h}</th>" for h in header)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
            return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        return (f"<b>{len(snaps)} snapshot(s)</b>" + (table(("tag", "status", "branched from", "pause"), snaps)
                                                       if snaps else "")
                + f"<b>{len(sbs)} sandbox(es)</b>" + (table(("id", "snapshot", "branches"), sbs) if sbs else ""))


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


# --- argument parsers, one per subcommand (their help is %forkd?'s help) ----------------------------

def _parser(name: str, doc: str):
    def stub():
        pass
    stub.__doc__ = doc
    stub.__name__ = name
    return stub


def _args(name: str, doc: str, *arguments):
    """A magic_arguments parser for ``%forkd <name>``: ``arguments`` are ``argument(...)`` decorators."""
    fn = _parser(name, doc)
    for arg in reversed(arguments):
        fn = arg(fn)
    fn = magic_arguments.magic_arguments(name=f"forkd {name}")(fn)
    return fn


A = magic_arguments.argument

SUBCOMMANDS = {
    "snapshot": _args(
        "snapshot", "Create a snapshot: a warmed-up interpreter, frozen. As a cell magic "
                    "(%%forkd snapshot -t T) the cell is the setup code. Returns a Snapshot.",
        A("--tag", "-t", required=True, help="the snapshot's tag"),
        A("--setup", default=None, help="Python code run before the interpreter is frozen"),
        A("--engine", default="auto", help="auto, process or vm"),
        A("--mem-size-mib", type=int, default=None, help="memory size (VM engine)"),
        A("--disk-mib", type=int, default=None, help="an ext4 data disk at /data (VM engine)"),
        A("--package", action="append", default=None, metavar="DEB",
          help="a Debian package for the guest, e.g. python3-numpy (VM engine; repeatable)")),
    "fork": _args(
        "fork", "Fork sandboxes (copy-on-write children) from a snapshot. Returns a list of Sandbox. In the "
                "forkd kernel, with no --tag, forks the notebook itself: n sandboxes of its current state.",
        A("--tag", "-t", default=None, help="the snapshot to fork from"),
        A("-n", type=int, default=1, help="how many sandboxes (default 1)"),
        A("--memory-limit-mib", type=int, default=None, help="memory limit of each sandbox"),
        A("--lossy", action="store_true", help="forking the notebook: go ahead even if running work "
                                               "(threads, child processes) stays behind, with a warning")),
    "branch": _args(
        "branch", "Turn a running sandbox into a new snapshot (it keeps running). Returns a Snapshot; "
                  "with --no-wait (implies --live) its status is 'writing' until it turns 'ready'. In the "
                  "forkd kernel, with no sandbox, branches the notebook itself.",
        A("sandbox", nargs="?", default=None, help="the sandbox id (or a variable holding a Sandbox)"),
        A("--tag", "-t", default=None, help="the new snapshot's tag (default branch-<id>-<n>)"),
        A("--diff", action="store_true", help="diff branch"),
        A("--live", action="store_true", help="live branch: the shortest pause of the source"),
        A("--no-wait", action="store_true", help="return as soon as the source has resumed"),
        A("--lossy", action="store_true", help="branch even if running work (threads, child processes) "
                                               "stays behind; a warning lists it")),
    "ls": _args("ls", "List snapshots and sandboxes. Returns a Listing (.snapshots, .sandboxes)."),
    "kill": _args(
        "kill", "Kill sandboxes: by id, every sandbox of a snapshot (--tag), or all (--all).",
        A("sandboxes", nargs="*", help="sandbox ids (or variables holding Sandbox objects)"),
        A("--tag", "-t", default=None, help="every sandbox forked from this snapshot"),
        A("--all", action="store_true", help="every sandbox")),
    "exec": _args(
        "exec", "Run a command in a sandbox: %forkd exec SB -- cmd args. Returns a CommandResult.",
        A("sandbox", help="the sandbox id (or a variable holding a Sandbox)"),
        A("command", nargs="*", help="the command and its arguments (after --)"),
        A("--timeout", type=float, default=30, help="seconds (default 30)")),
    "delete": _args(
        "delete", "Delete a snapshot (its running sandboxes keep running).",
        A("tag", help="the snapshot's tag"),
        A("--cascade", action="store_true", help="also delete the snapshots branched below it")),
    "tree": _args(
        "tree", "Show the lineage tree as a live widget. Returns the LineageWidget.",
        A("--static", action="store_true", help="do not follow live changes")),
    "run": _args(
        "run", "Cell magic: %%forkd run (SB ... | --tag T | --all) runs the cell in those sandboxes in "
               "parallel and shows their outputs side by side. Returns {sandbox id: Execution}.",
        A("sandboxes", nargs="*", help="sandbox ids (or variables holding Sandbox objects or lists of them)"),
        A("--tag", "-t", default=None, help="every sandbox forked from this snapshot"),
        A("--all", action="store_true", help="every sandbox"),
        A("--timeout", type=float, default=None, help="seconds per sandbox"),
        A("--each", action="append", default=None, metavar="NAME=VALUES",
          help="give each sandbox its own value: NAME=EXPR, EXPR a list as long as the sandboxes, "
               "e.g. --each \"lr=[0.01, 0.1, 1.0]\"; the i-th sandbox runs NAME = EXPR[i] first "
               "(repeatable; values must be literals: numbers, strings, lists, dicts)")),
    "gather": _args(
        "gather", "Evaluate EXPR in each sandbox and bind {sandbox id: value} to NAME in the notebook "
                  "(in the forkd kernel, in the notebook's sandbox). Values travel pickled.",
        A("sandboxes", nargs="+", help="sandbox ids (or variables holding Sandbox objects or lists of them)"),
        A("--expr", "-e", required=True, help="the Python expression evaluated in each sandbox"),
        A("--out", "-o", required=True, help="the name bound in the notebook")),
    "checkout": _args(
        "checkout", "forkd kernel: run the next cells in another sandbox (its state), a fresh child of a "
                    "snapshot, or (-) where the notebook was before.",
        A("target", help="a sandbox (id or variable), a snapshot tag, or - for the previous one")),
    "head": _args("head", "forkd kernel: the sandbox this notebook runs in, and its lineage."),
    "log": _args("log", "forkd kernel: how the notebook got where it is: the cells run since each branch."),
    "connect": _args(
        "connect", "Use another server (default: $FORKD_URL, else the server found on this host).",
        A("url", nargs="?", default=None, help="the server's URL, e.g. http://127.0.0.1:8889"),
        A("--token", default=None, help="its token (default $FORKD_TOKEN)")),
}

_HELP = """Fork-on-write Python sandboxes from a notebook.

  %forkd snapshot -t py --setup "import numpy as np"     -> Snapshot
  %forkd fork -t py -n 4                                  -> [Sandbox, ...]
  %forkd branch SB [-t TAG] [--diff|--live] [--no-wait]   -> Snapshot
  In the "Python 3 (forkd)" kernel, the notebook itself:
  %forkd branch --live | fork -n 5 | checkout SB|TAG|- | head | log
  %forkd ls | kill (SB ... | -t TAG | --all) | delete TAG | exec SB -- cmd | tree | connect URL
  %%forkd run (SB ... | -t TAG | --all)                   -> runs the cell in each, side by side

Subcommands:

"""


@magics_class
class ForkdMagics(Magics):
    """The ``%forkd`` magics. ``controller`` defaults to the SDK's (``$FORKD_URL`` or discovery)."""

    def __init__(self, shell=None, controller: Controller | None = None):
        super().__init__(shell)
        self._controller = controller

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            self._controller = Controller()
        return self._controller

    @line_cell_magic
    def forkd(self, line: str, cell: str | None = None):
        sub, _, rest = line.strip().partition(" ")
        if sub in ("", "help", "-h", "--help"):
            print(self.forkd.__doc__)
            return None
        parser = SUBCOMMANDS.get(sub)
        if parser is None:
            raise UsageError(f"forkd: unknown subcommand {sub!r}; use one of {', '.join(SUBCOMMANDS)} (%forkd?)")
        if rest.strip() in ("-h", "--help"):
            print(parser.__doc__)
            return None
        if sub == "run" and cell is None:
            raise UsageError("forkd run is a cell magic: put %%forkd run SB ... on the first line of a cell")
        if cell is not None and sub not in ("run", "snapshot"):
            raise UsageError(f"forkd {sub} is a line magic: use %forkd {sub} (one %)")
        command = ""
        if sub == "exec" and " -- " in f" {rest} ":
            rest, _, command = f" {rest} ".partition(" -- ")
        args = magic_arguments.parse_argstring(parser, rest)
        for name, value in vars(args).items():  # IPython splits without removing the quotes
            if isinstance(value, str):
                setattr(args, name, _unquote(value))
            elif isinstance(value, list):
                setattr(args, name, [_unquote(v) if isinstance(v, str) else v for v in value])
        if sub == "exec" and command.strip():
            args.command = [command.strip()]
        try:
            return getattr(self, f"_{sub}")(args, cell)
        except ControllerError as exc:
            raise UsageError(f"forkd {sub}: {exc.message} (HTTP {exc.status})") from None
        except (ServerUnreachable, TimeoutError, RuntimeError) as exc:
            raise UsageError(f"forkd {sub}: {exc}") from None

    # --- helpers ---------------------------------------------------------------------------------

    def _sandbox_ids(self, names: list[str]) -> list[str]:
        """Ids from ids, or from variables holding a Sandbox or a list of them."""
        ns = self.shell.user_ns if self.shell is not None else {}
        ids: list[str] = []
        for name in names:
            value = ns.get(name, name) if name.isidentifier() else name
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, Sandbox):
                    ids.append(item.id)
                elif isinstance(item, str):
                    ids.append(item)
                else:
                    raise UsageError(f"forkd: {name} is a {type(item).__name__}, not a sandbox")
        return ids

    def head(self) -> str | None:
        """The sandbox this notebook runs in: only the forkd kernel has one."""
        return None

    def head_state(self) -> object:
        """A token that changes whenever the notebook's state may have (a cell ran, HEAD moved)."""
        return None

    def _needs_kernel(self, what: str) -> UsageError:
        return UsageError(f"forkd {what}: this notebook runs in a plain kernel, not in a sandbox; use the "
                          f"\"Python 3 (forkd)\" kernel (Kernel > Change Kernel) for the notebook to {what} "
                          f"itself, or name a sandbox")

    def _one_sandbox(self, name: str) -> str:
        ids = self._sandbox_ids([name])
        if len(ids) != 1:
            raise UsageError(f"forkd: {name} names {len(ids)} sandboxes; give exactly one")
        return ids[0]

    def _targets(self, args) -> list[str]:
        if args.all or args.tag:
            sandboxes = self.controller.list_sandboxes()
            if args.tag:
                sandboxes = [s for s in sandboxes if s["snapshot_tag"] == args.tag]
            return sorted(s["id"] for s in sandboxes)
        return self._sandbox_ids(args.sandboxes)

    # --- subcommands -----------------------------------------------------------------------------

    def _snapshot(self, args, cell):
        setup = cell if cell is not None and cell.strip() else args.setup
        info = self.controller.create_snapshot(args.tag, setup=setup, engine=args.engine,
                                               mem_size_mib=args.mem_size_mib, disk_mib=args.disk_mib,
                                               packages=args.package)
        return Snapshot(info, self.controller)

    def _fork(self, args, cell):
        if args.n < 1:
            raise UsageError("forkd fork: -n must be at least 1")
        if args.tag is None:
            head = self.head()
            if head is None:
                raise self._needs_kernel("fork")
            # n copies of the notebook's state: its last branch if nothing ran since, else a new one
            state, tag = getattr(self, "_head_branch", (None, None))
            if tag is None or state != self.head_state() or not self._snapshot_ready(tag):
                tag = self.controller.branch_sandbox(head, lossy=args.lossy)["tag"]
                self._head_branch = (self.head_state(), tag)
            args.tag = tag
        infos = self.controller.spawn_sandboxes(args.tag, args.n, memory_limit_mib=args.memory_limit_mib)
        return [Sandbox(i, self.controller) for i in infos]

    def _branch(self, args, cell):
        if args.diff and args.live:
            raise UsageError("forkd branch: --diff and --live exclude each other")
        if args.sandbox is None:
            sandbox = self.head()
            if sandbox is None:
                raise self._needs_kernel("branch")
        else:
            sandbox = self._one_sandbox(args.sandbox)
        mode = "diff" if args.diff else "live" if (args.live or args.no_wait) else None
        info = self.controller.branch_sandbox(sandbox, args.tag, mode=mode, wait=not args.no_wait, lossy=args.lossy)
        if args.sandbox is None:
            self._head_branch = (self.head_state(), info["tag"])  # fork -n reuses it while nothing changed
        return Snapshot(info, self.controller)

    def _ls(self, args, cell):
        ctl = self.controller
        return Listing([Snapshot(s, ctl) for s in ctl.list_snapshots()],
                       [Sandbox(b, ctl) for b in ctl.list_sandboxes()])

    def _kill(self, args, cell):
        if not (args.sandboxes or args.tag or args.all):
            raise UsageError("forkd kill: name sandboxes, or use --tag T or --all")
        ids = self._targets(args)
        for sb in ids:
            try:
                self.controller.kill_sandbox(sb)
            except ControllerError as exc:
                if exc.status != 404 or not (args.all or args.tag):  # gone meanwhile is fine for a sweep
                    raise
        print(f"killed {len(ids)} sandbox{'es' if len(ids) != 1 else ''}")

    def _exec(self, args, cell):
        if not args.command:
            raise UsageError("forkd exec: give a command: %forkd exec SB -- cmd args")
        sandbox = self._one_sandbox(args.sandbox)
        cmd = " ".join(args.command)
        r = self.controller.exec_command(sandbox, ["/bin/sh", "-c", cmd], args.timeout)
        return ExecResult(r.get("stdout", ""), r.get("stderr", ""), r.get("exit_code", 1), r.get("error"))

    def _delete(self, args, cell):
        self.controller.delete_snapshot(args.tag, cascade=args.cascade)
        print(f"deleted snapshot {args.tag}")

    def _tree(self, args, cell):
        from ._widget import LineageWidget
        return LineageWidget(self.controller, live=not args.static)

    def _run(self, args, cell):
        targets = self._targets(args)
        if not targets:
            raise UsageError("forkd run: no sandboxes to run in (name them, or use --tag T or --all)")
        from ._live import run_live
        preludes = self._each(args.each or [], len(targets))
        results = run_live(self.controller, targets, cell, args.timeout, preludes=preludes)
        failed = results.failed
        if failed:
            display(results)  # every column, then the cell fails
            first = results[failed[0]].error or {}
            raise UsageError(f"forkd run: the cell failed in {len(failed)} of {len(results)} sandboxes "
                             f"({failed[0]}: {first.get('ename')}: {first.get('evalue')})")
        return results

    def _gather(self, args, cell):
        import base64
        import pickle
        if not args.out.isidentifier():
            raise UsageError(f"forkd gather: --out must be a Python name, got {args.out!r}")
        ids = self._sandbox_ids(args.sandboxes)
        code = f"__import__('base64').b64encode(__import__('pickle').dumps(({args.expr}))).decode()"
        values = {}
        for sb in ids:
            reply = self.controller.eval_code(sb, code)
            if reply.get("error"):
                raise UsageError(f"forkd gather: in {sb}: {reply['error']}")
            values[sb] = pickle.loads(base64.b64decode(eval(reply["result"])))  # noqa: S307,S301 - our own repr of a str
        self.bind_in_notebook(args.out, values)
        print(f"{args.out} = {{{len(values)} sandbox ids: {args.expr}}}")

    def bind_in_notebook(self, name: str, value) -> None:
        """Bind a value where the notebook's code runs (here: this kernel's namespace)."""
        self.shell.user_ns[name] = value

    def _snapshot_ready(self, tag: str) -> bool:
        try:
            return self.controller.snapshot_info(tag).get("status") == "ready"
        except ControllerError:
            return False

    def _each(self, specs: list[str], n: int) -> list[str]:
        """``--each NAME=EXPR``: one line of code per sandbox binding NAME to its own value."""
        import ast
        lines = [""] * n
        for spec in specs:
            name, sep, expr = _unquote(spec).partition("=")
            name = name.strip()
            if not sep or not name.isidentifier():
                raise UsageError(f"forkd run: --each takes NAME=EXPR, e.g. --each \"lr=[0.01, 0.1]\"; got {spec!r}")
            ns = self.shell.user_ns if self.shell is not None else {}
            try:
                values = eval(expr, ns)  # noqa: S307 - the user's own namespace, like {expr} expansion
            except NameError as exc:
                raise UsageError(f"forkd run: --each {name}: {exc}") from None
            if not isinstance(values, (list, tuple)) or len(values) != n:
                raise UsageError(f"forkd run: --each {name} needs a list of {n} values (one per sandbox), "
                                 f"got {type(values).__name__} of {len(values) if hasattr(values, '__len__') else '?'}")
            for i, value in enumerate(values):
                text = repr(value)
                try:
                    if ast.literal_eval(text) != value:
                        raise ValueError
                except (ValueError, SyntaxError):
                    raise UsageError(f"forkd run: --each {name}: {text[:60]} is not a literal a sandbox can "
                                     f"receive (numbers, strings, lists, dicts)") from None
                lines[i] += f"{name} = {text}\n"
        return lines

    def _checkout(self, args, cell):
        raise self._needs_kernel("checkout")

    def _head(self, args, cell):
        raise self._needs_kernel("head")

    def _log(self, args, cell):
        raise self._needs_kernel("log")

    def _connect(self, args, cell):
        self._controller = Controller(args.url, args.token)
        self._controller.healthz()
        print(f"forkd: using {self._controller.base_url}")
        return self._controller


ForkdMagics.forkd.__doc__ = _HELP + "\n".join(p.__doc__ for p in SUBCOMMANDS.values())
