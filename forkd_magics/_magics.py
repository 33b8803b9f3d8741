"""``%forkd`` / ``%%forkd``: snapshot, fork, keep, branch, list, kill, exec, tree, run-in-parallel,
push/pull and the tiers (freeze, store, wake).

Every subcommand talks to the server through the client SDK and returns SDK objects
(``Snapshot``, ``[Sandbox]``, ``CommandResult``...), so ``kids = %forkd fork -t py -n 4`` works.
The line reads like Python and a shell: ``{expr}`` is expanded (by IPython), ``# comments`` end it,
variables name sandboxes and an undefined one is a ``NameError``. What the magics create carries
this notebook's labels, and ``ls``, ``tree`` and ``--all`` mean this notebook's (``_scope``). A server
error or a bad argument is one ``UsageError`` saying what failed and what to do, in two lines, and
the error's details shown collapsed under it (``_errors``).
"""

from __future__ import annotations

import dataclasses
import getpass
import html
import os
import sys

from IPython.core import magic_arguments
from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand
from IPython.utils.text import DollarFormatter
from IPython.display import display

from forkd_server.client import (BadServerURL, CommandResult, Controller, ControllerError, Sandbox, ServerUnreachable,
                                 Snapshot, unanswered)

from ._args import SUBCOMMANDS, full_help, plain_help, strip_comment, unquote
from ._errors import Explained, explained, show_details
from ._names import plainly, sandbox_ids, snapshot_tag, undefined_name
from ._scope import Scope, kernel_bases, sandboxes_of, snapshots_of
from ._static import host_label
from ._tiers import tier_line

__all__ = ["ForkdMagics", "ExecResult", "Listing"]


def spawn_when_written(controller, tag: str, n: int, **options) -> list[dict]:
    """``n`` sandboxes of snapshot ``tag``. One still being written (a ``branch --no-wait``, a creation
    still in its setup), which the server refuses to spawn from, is waited for first, as the SDK's
    ``Snapshot.fork`` waits."""
    try:
        return controller.spawn_sandboxes(tag, n, **options)
    except ControllerError as exc:
        if exc.status != 409 or controller.snapshot_info(tag).get("status") != "writing":
            raise
    controller.wait_snapshot(tag)
    return controller.spawn_sandboxes(tag, n, **options)




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

    def __init__(self, snapshots: list[Snapshot], sandboxes: list[Sandbox], scope: str = "everyone",
                 missing: dict[str, str] | None = None):
        self.snapshots, self.sandboxes, self.scope = snapshots, sandboxes, scope
        self.missing = missing or {}  # behind a router: hosts that did not answer (url -> why)

    @property
    def _unlisted(self) -> list[str]:
        """One line per host a router left out: what it holds is not in the tables, nor gone."""
        return [f"⚠ {host_label(url)} did not answer ({why}): what it holds is not listed"
                for url, why in self.missing.items()]

    @property
    def _of(self) -> str:
        return "" if self.scope == "everyone" else f" of {self.scope}"

    def _hosts(self, item) -> list[str]:
        """Where an item is behind a fleet's router (a snapshot: every host that holds it)."""
        info = item.info or {}
        held = info.get("hosts") or ([info["host"]] if info.get("host") else [])
        return [host_label(h) for h in held if isinstance(h, str)]

    @property
    def spans_hosts(self) -> bool:
        """More than one host to tell apart (a fleet's router): the tables then say each one's."""
        return len({h for item in [*self.snapshots, *self.sandboxes] for h in self._hosts(item)}) > 1

    def _rows(self):
        where = self.spans_hosts
        snaps = [(s.tag, s.status, s.branched_from or "", "" if s.pause_ms is None else f"{s.pause_ms:.2f} ms")
                 + ((", ".join(self._hosts(s)),) if where else ())
                 for s in sorted(self.snapshots, key=lambda s: s.tag)]
        sbs = [(b.id, b.snapshot_tag, b.tier, str(b.info.get("branch_count", 0)))
               + ((", ".join(self._hosts(b)),) if where else ())
               for b in sorted(self.sandboxes, key=lambda b: b.id)]
        return snaps, sbs

    def _headers(self, upper: bool) -> tuple[tuple, tuple]:
        snap, sb = ("tag", "status", "branched from", "pause"), ("id", "snapshot", "tier", "branches")
        if self.spans_hosts:
            snap, sb = (*snap, "host"), (*sb, "host")
        return tuple(h.upper() for h in snap) if upper else snap, tuple(h.upper() for h in sb) if upper else sb

    @staticmethod
    def _text_table(header, rows) -> list[str]:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return [fmt.format(*header).rstrip()] + [fmt.format(*r).rstrip() for r in rows]

    def _repr_pretty_(self, p, cycle) -> None:
        snaps, sbs = self._rows()
        snap_head, sb_head = self._headers(upper=True)
        lines = [f"{len(snaps)} snapshot(s){self._of}"]
        if snaps:
            lines += self._text_table(snap_head, snaps)
        lines.append(f"{len(sbs)} sandbox(es)")
        if sbs:
            lines += self._text_table(sb_head, sbs)
        p.text("\n".join(lines + self._unlisted))

    def _repr_html_(self) -> str:
        snaps, sbs = self._rows()

        def table(header, rows):
            head = "".join(f"<th>{h}</th>" for h in header)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
            return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        snap_head, sb_head = self._headers(upper=False)
        return (f"<b>{len(snaps)} snapshot(s){html.escape(self._of)}</b>" + (table(snap_head, snaps) if snaps else "")
                + f"<b>{len(sbs)} sandbox(es)</b>" + (table(sb_head, sbs) if sbs else "")
                + "".join(f"<p>{html.escape(line)}</p>" for line in self._unlisted))


@magics_class
class ForkdMagics(Magics):
    """The ``%forkd`` magics. ``controller`` defaults to the SDK's (``$FORKD_URL`` or discovery);
    ``scope`` to this notebook (its kernel id and path, see ``_scope``)."""

    def __init__(self, shell=None, controller: Controller | None = None, scope: Scope | None = None):
        super().__init__(shell)
        self._controller = controller
        self._scope = scope

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            self._controller = Controller()
        return self._controller

    @property
    def scope(self) -> Scope:
        """This notebook: what the magics label, and what ls / tree / --all show and act on."""
        if self._scope is None:
            self._scope = Scope.current()  # a kernel's id and notebook do not change while it runs
        return Scope(self._scope.kernel_id, self._scope.notebook, self.head())

    @property
    def user_ns(self) -> dict:
        return self.shell.user_ns if self.shell is not None else {}

    @no_var_expand  # the comment goes first: a {…} or $ in it would stop IPython expanding the line
    @line_cell_magic
    def forkd(self, line: str, cell: str | None = None):
        line = self._expand(strip_comment(line))
        sub, _, rest = line.strip().partition(" ")
        if sub in ("", "help", "-h", "--help"):
            print(self.forkd.__doc__)
            return None
        parser = SUBCOMMANDS.get(sub)
        if parser is None:
            raise UsageError(f"forkd: unknown subcommand {sub!r}; use one of {', '.join(SUBCOMMANDS)} (%forkd?)")
        if rest.strip() in ("-h", "--help"):
            print(plain_help(sub))
            return None
        if sub == "run" and cell is None:
            raise UsageError("forkd run is a cell magic: put %%forkd run SB ... on the first line of a cell")
        if cell is not None and sub not in ("run", "snapshot"):
            raise UsageError(f"forkd {sub} is a line magic: use %forkd {sub} (one %)")
        if sub == "connect" and any(w == "--token" or w.startswith("--token=") for w in rest.split()):
            raise UsageError("forkd connect: not --token on the line: the notebook (and its history) would keep "
                             "the secret\nset FORKD_TOKEN before starting Jupyter, or leave it out and type it at "
                             "the prompt, which does not echo")
        command = ""
        if sub == "exec" and " -- " in f" {rest} ":
            rest, _, command = f" {rest} ".partition(" -- ")
        args = magic_arguments.parse_argstring(parser, rest)
        for name, value in vars(args).items():  # IPython splits without removing the quotes
            if isinstance(value, str):
                setattr(args, name, unquote(value))
            elif isinstance(value, list):
                setattr(args, name, [unquote(v) if isinstance(v, str) else v for v in value])
        if sub == "exec" and command.strip():
            args.command = [command.strip()]
        try:
            return getattr(self, f"_{sub}")(args, cell)
        except (ControllerError, ServerUnreachable, BadServerURL, TimeoutError, RuntimeError) as exc:
            said = self.explained(exc)
            error = UsageError(f"forkd {sub}: {said}")  # two lines: what, and what to do
            error.details = said.details
            show_details(self.shell, said.details)      # the rest, collapsed under the error
            raise error from None
        except KeyboardInterrupt as exc:  # stopped waiting, mostly in the SDK's socket read: its frames mean nothing here
            if hasattr(exc, "_render_traceback_"):  # said already (an interrupted %%forkd run)
                raise
            where = ("%forkd head says where the notebook is now" if sub in ("checkout", "keep")
                     else "%forkd ls lists what there is now")
            raise plainly(KeyboardInterrupt(f"forkd {sub}: interrupted while waiting for the server, which may "
                                            f"still finish it\n{where}")) from None

    def _expand(self, line: str) -> str:
        """``{expr}`` and ``$name``, as IPython expands a magic's line: in the namespace of the code
        that ran the magic (a function's locals too); a line that fails to expand stays as written."""
        if self.shell is None:
            return line
        frame = sys._getframe(1)
        runners = {InteractiveShell.run_line_magic.__code__, InteractiveShell.run_cell_magic.__code__}
        while frame is not None and frame.f_code not in runners:
            frame = frame.f_back
        ns = dict(self.shell.user_ns)
        if frame is not None and frame.f_back is not None:
            ns.update(frame.f_back.f_locals)
        try:
            return DollarFormatter().vformat(line, args=[], kwargs=ns)
        except Exception:  # noqa: BLE001 - IPython's rule: what does not expand stays as written
            return line

    def explained(self, exc: BaseException) -> Explained:
        server = self._controller.base_url if self._controller is not None else "the forkd server"
        return explained(exc, server)

    def explain(self, exc: BaseException) -> str:
        return str(self.explained(exc))

    # --- helpers ---------------------------------------------------------------------------------

    def _sandbox_ids(self, names: list[str], sub: str = "") -> list[str]:
        """Ids from ids, or from variables (expressions) holding a Sandbox or a list of them."""
        return sandbox_ids(names, self.user_ns, sub)

    def _tag(self, token: str, sub: str) -> str:
        return snapshot_tag(token, self.user_ns, sub)

    def head(self) -> str | None:
        """The sandbox this notebook runs in: only the forkd kernel has one."""
        return None

    def head_memory_limit_mib(self) -> int | None:
        """The memory limit of copies of the notebook (``fork -n`` of HEAD); None: the server's default."""
        return None

    # what the forkd kernel gives the notebook, for each subcommand that needs it (fork and branch
    # also take a sandbox; checkout, head and log are about the notebook itself)
    _ON_THE_KERNEL = {"fork": "fork itself, or name a sandbox", "branch": "branch itself, or name a sandbox",
                      "checkout": "run in a sandbox (here, %%forkd run SB runs a cell in one)",
                      "head": "run in a sandbox (%forkd ls lists the ones this notebook made)",
                      "log": "run in a sandbox (%forkd ls lists the ones this notebook made)"}

    def _needs_kernel(self, what: str) -> UsageError:
        return UsageError(f"forkd {what}: this notebook runs in a plain kernel, not in a sandbox\nuse the "
                          f"\"Python 3 (forkd)\" kernel (Kernel > Change Kernel) for the notebook to "
                          f"{self._ON_THE_KERNEL[what]}")

    def _one_sandbox(self, name: str, sub: str) -> str:
        ids = self._sandbox_ids([name], sub)
        if len(ids) != 1:
            raise UsageError(f"forkd {sub}: {name} names {len(ids)} sandboxes; give exactly one")
        return ids[0]

    def _within(self, args) -> Scope | None:
        """The scope of --all / ls / tree: this notebook's, or (--everyone) None for all."""
        return None if getattr(args, "everyone", False) else self.scope

    def _targets(self, args, sub: str) -> list[str]:
        """The sandboxes named, or swept by --tag / --all (never the notebook's own: name it for that)."""
        if args.tag:
            tag = self._tag(args.tag, sub)
            found = [s for s in self.controller.list_sandboxes() if s["snapshot_tag"] == tag]
        elif args.all or args.everyone:  # --everyone alone: all of them on the server
            scope = self._within(args)  # without HEAD, which a sweep leaves out
            found = sandboxes_of(self.controller, scope and dataclasses.replace(scope, head=None))
        else:
            return self._sandbox_ids(args.sandboxes, sub)
        head = self.head()  # checked-out copies carry the notebook's labels, HEAD among them
        return sorted(s["id"] for s in found if s["id"] != head)

    # --- subcommands -----------------------------------------------------------------------------

    def _snapshot(self, args, cell):
        setup = cell if cell is not None and cell.strip() else args.setup
        info = self.controller.create_snapshot(args.tag, setup=setup, engine=args.engine,
                                               mem_size_mib=args.mem_size_mib, disk_mib=args.disk_mib,
                                               packages=args.package, labels=self.scope.labels)
        return Snapshot(info, self.controller)

    def _fork(self, args, cell):
        if args.n < 1:
            raise UsageError("forkd fork: -n must be at least 1")
        labels, limit = self.scope.labels, args.memory_limit_mib
        if args.tag is not None:
            if args.sandbox is not None:
                raise UsageError("forkd fork: give a sandbox (a fork tree of it) or --tag (children of a snapshot), "
                                 "not both")
            infos = spawn_when_written(self.controller, self._tag(args.tag, "fork"), args.n, memory_limit_mib=limit,
                                       labels=labels)
            return [Sandbox(i, self.controller) for i in infos]
        if args.sandbox is not None:
            source = self._one_sandbox(args.sandbox, "fork")
        else:  # n copies of the notebook's state
            source = self.head()
            if source is None:
                raise self._needs_kernel("fork")
        if limit is None and source == self.head():  # copies of the notebook, which may be checked out
            limit = self.head_memory_limit_mib()
        try:
            tree = self.controller.fork_sandbox(source, args.n, memory_limit_mib=limit, labels=labels,
                                                lossy=args.lossy)
        except ControllerError as exc:  # the wire's name for -n is `count`
            if said := exc.about_field("count"):
                raise UsageError(f"forkd fork: -n {said}") from None
            raise
        return [Sandbox(i, self.controller) for i in tree["sandboxes"]]

    def _keep(self, args, cell):
        winner = self._one_sandbox(args.sandbox, "keep")
        self.before_keep(winner)
        result = self.controller.promote_sandbox(winner, cleanup_siblings=not args.keep_siblings)
        killed, released = result["killed"], result["released"]
        print(f"kept {winner} (fork tree {result['fork_tree_id']}): killed {len(killed)} "
              f"sibling{'' if len(killed) == 1 else 's'}" + (f", released snapshot {', '.join(released)}" if released else ""))
        for kept in result["kept"]:
            print(f"  kept {kept['kind']} {kept['id']}: {kept['reason']}")
        sys.stdout.flush()  # said before the winner is shown as the cell's result
        if result["failed"]:
            lines = "".join(f"\n  {f['id']}: {f['error']}" for f in result["failed"])
            raise UsageError(f"forkd keep: could not kill {len(result['failed'])} sibling(s) (%forkd kill them):{lines}")
        return Sandbox(result["winner"], self.controller)

    def before_keep(self, winner: str) -> None:
        """What happens before a winner is kept (the forkd kernel moves the notebook into it)."""

    def _branch(self, args, cell):
        if args.diff and args.live:
            raise UsageError("forkd branch: --diff and --live exclude each other")
        if args.sandbox is None:
            sandbox = self.head()
            if sandbox is None:
                raise self._needs_kernel("branch")
        else:
            sandbox = self._one_sandbox(args.sandbox, "branch")
        mode = "diff" if args.diff else "live" if (args.live or args.no_wait) else None
        info = self.controller.branch_sandbox(sandbox, args.tag, mode=mode, wait=not args.no_wait, lossy=args.lossy,
                                              labels=self.scope.labels)
        return Snapshot(info, self.controller)

    def _ls(self, args, cell):
        ctl, scope = self.controller, self._within(args)
        snaps, boxes = snapshots_of(ctl, scope), sandboxes_of(ctl, scope)
        return Listing([Snapshot(s, ctl) for s in snaps], [Sandbox(b, ctl) for b in boxes], str(scope or "everyone"),
                       unanswered(snaps, boxes))

    def _kill(self, args, cell):
        if not (args.sandboxes or args.tag or args.all or args.everyone):
            raise UsageError("forkd kill: name sandboxes, or use --tag T, --all (this notebook's) or --everyone")
        ids = self._targets(args, "kill")
        sweep = bool(args.all or args.tag or args.everyone)
        killed, failed = [], []
        for sb in dict.fromkeys(ids):  # each once, in order; one that fails does not stop the others
            try:
                self.controller.kill_sandbox(sb)
                killed.append(sb)
            except ControllerError as exc:
                if exc.status == 404 and not sweep:
                    failed.append((sb, "no such sandbox is running (killed already, or a wrong id)"))
                elif exc.status != 404:  # gone meanwhile is fine for a sweep
                    failed.append((sb, self.explained(exc).what))
            except (ServerUnreachable, TimeoutError) as exc:
                failed.append((sb, self.explained(exc).what))
        if killed or not failed:
            print(f"killed {len(killed)} sandbox{'es' if len(killed) != 1 else ''}")
        if len(failed) == 1 and not killed:
            raise UsageError(f"forkd kill: {failed[0][0]}: {failed[0][1]}")
        if failed:
            lines = "".join(f"\n  {sb}: {why}" for sb, why in failed)
            raise UsageError(f"forkd kill: could not kill {len(failed)} of {len(killed) + len(failed)}:{lines}")

    def _exec(self, args, cell):
        if not args.command:
            raise UsageError("forkd exec: give a command: %forkd exec SB -- cmd args")
        sandbox = self._one_sandbox(args.sandbox, "exec")
        cmd = " ".join(args.command)
        r = self.controller.exec_command(sandbox, ["/bin/sh", "-c", cmd], args.timeout)
        return ExecResult(r.get("stdout", ""), r.get("stderr", ""), r.get("exit_code", 1), r.get("error"))

    def _push(self, args, cell):
        tag = self._tag(args.tag, "push")
        out = self.controller.push_snapshot(tag)
        print(f"pushed {tag} to {out['store']}: {out['uploaded_chunks']} of {out['chunks']} chunks uploaded "
              f"({out['uploaded_bytes'] / 1e6:.1f} MB), the rest were there")
        return out["digest"]

    def _pull(self, args, cell):
        if (args.tag is None) == (args.digest is None):
            raise UsageError("forkd pull: give a TAG or --digest sha256:... (one of them)")
        info = self.controller.pull_snapshot(args.tag, digest=args.digest)
        figures = info.get("pull")
        if figures is None:  # the same snapshot was there already
            print(f"{info['tag']} is already on the server: nothing fetched")
        else:
            print(f"pulled {info['tag']}: {figures['fetched_chunks']} of {figures['chunks']} chunks fetched "
                  f"({figures['fetched_bytes'] / 1e6:.1f} MB), the rest were on the server")
        return Snapshot(info, self.controller)

    def _freeze(self, args, cell):
        self._move("freeze", self.controller.freeze_sandbox, args)

    def _store(self, args, cell):
        self._move("store", self.controller.store_sandbox, args)

    def _wake(self, args, cell):
        self._move("wake", self.controller.wake_sandbox, args)

    def _move(self, sub: str, move, args) -> None:
        """A sandbox's tier by hand: one line saying where it is now (and how long a wake took)."""
        info = move(self._one_sandbox(args.sandbox, sub))
        print(tier_line(info))

    def _delete(self, args, cell):
        sweep = args.all or args.everyone
        if bool(args.tags) == bool(sweep):
            raise UsageError("forkd delete: name snapshots (TAG ...), or use --all (this notebook's) or --everyone")
        bases = kernel_bases(self.controller)
        if args.tags:  # named: deleted even when a kernel forks from it, which is said
            tags = list(dict.fromkeys(self._tag(t, "delete") for t in args.tags))
            if len(tags) == 1:
                self.controller.delete_snapshot(tags[0], cascade=args.cascade)
                print(f"deleted snapshot {tags[0]}")
            else:
                self._delete_each(tags, args.cascade, sweep=False)
            for tag in (t for t in tags if t in bases):
                print(f"{tag} was the base snapshot of the forkd kernel of {', '.join(bases[tag])}: its next restart "
                      f"makes it again (or, for a base named by $FORKD_KERNEL_BASE, cannot start until it exists)")
            return
        # deepest first, so each is a leaf when its turn comes
        snaps = sorted(snapshots_of(self.controller, self._within(args)), key=lambda s: -len(s.get("lineage") or []))
        # a base a kernel forks from goes only by name: a bulk delete keeps it (and, with --cascade,
        # the snapshots it was branched from, which would take it along), and says so
        protected = set(bases)
        if args.cascade and bases:
            protected.update(t for s in self.controller.list_snapshots() if s["tag"] in bases
                             for t in s.get("lineage") or [])
        self._delete_each([s["tag"] for s in snaps if s["tag"] not in protected], args.cascade, sweep=True,
                          kept=[(s["tag"], bases.get(s["tag"])) for s in snaps if s["tag"] in protected])

    def _delete_each(self, tags: list[str], cascade: bool, *, sweep: bool, kept=()) -> None:
        """Delete each snapshot; one that fails does not stop the others, and the cell then fails
        naming each one and why."""
        deleted, failed = [], []
        for tag in tags:
            try:
                self.controller.delete_snapshot(tag, cascade=cascade)
                deleted.append(tag)
            except ControllerError as exc:
                if exc.status != 404 or not sweep:  # a sweep's snapshot gone with a cascade meanwhile is fine
                    failed.append((tag, self.explained(exc).what))
        print(f"deleted {len(deleted)} snapshot{'' if len(deleted) == 1 else 's'}")
        for tag, users in kept:
            print(f"kept {tag}: " + (f"the base snapshot of the forkd kernel of {', '.join(users)}, which a restart "
                                     f"forks from" if users else "a forkd kernel's base snapshot was branched from it, "
                                                                 "and --cascade would take that along")
                  + f"; %forkd delete {tag} deletes it by name")
        if failed:
            lines = "".join(f"\n  {tag}: {why}" for tag, why in failed)
            raise UsageError(f"forkd delete: could not delete {len(failed)} of {len(tags)}:{lines}")

    def _tree(self, args, cell):
        from ._widget import LineageWidget
        return LineageWidget(self.controller, live=not args.static, scope=self._within(args),
                             labels=self.scope.labels)

    def _run(self, args, cell):
        targets = self._targets(args, "run")
        if not targets:
            raise UsageError("forkd run: no sandboxes to run in (name them, or use --tag T or --all)")
        from ._live import run_live
        preludes = self._each(args.each or [], len(targets))
        results = run_live(self.controller, targets, cell, args.timeout, preludes=preludes, explain=self.explain)
        failed = results.failed
        if results.interrupted:  # the user's interrupt, as ipykernel reports one
            display(results)
            going = sorted(results.running)
            left = f"; it still runs in {', '.join(going)} (%forkd kill ends it)" if going else ""
            raise plainly(KeyboardInterrupt(f"forkd run: interrupted; the cell stopped in {len(failed)} of "
                                            f"{len(results)} sandboxes{left}"))
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
        ids = self._sandbox_ids(args.sandboxes, "gather")
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

    def _each(self, specs: list[str], n: int) -> list[str]:
        """``--each NAME=EXPR``: one line of code per sandbox binding NAME to its own value."""
        import ast
        lines = [""] * n
        for spec in specs:
            name, sep, expr = unquote(spec).partition("=")
            name = name.strip()
            if not sep or not name.isidentifier():
                raise UsageError(f"forkd run: --each takes NAME=EXPR, e.g. --each \"lr=[0.01, 0.1]\"; got {spec!r}")
            ns = self.shell.user_ns if self.shell is not None else {}
            try:
                values = eval(expr, ns)  # noqa: S307 - the user's own namespace, like {expr} expansion
            except NameError as exc:
                raise undefined_name(f"{exc}: in --each {name}=...") from None
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
        """The token: $FORKD_TOKEN, else (the server asks for one) a prompt that does not echo."""
        controller = Controller(args.url)
        controller.healthz()  # answers without a token: is anyone there at all
        try:
            controller.list_snapshots()
        except ControllerError as exc:
            if exc.status != 401:
                raise
            why = "refused $FORKD_TOKEN" if os.environ.get("FORKD_TOKEN") else "needs a token"
            try:
                controller.token = getpass.getpass(f"{controller.base_url} {why}; its token (not echoed): ").strip()
            except (StdinNotImplementedError, EOFError):  # nbconvert, a kernel without stdin
                raise UsageError(f"forkd connect: {controller.base_url} {why} and this front end cannot ask "
                                 f"for one: set FORKD_TOKEN where the kernel starts") from None
            controller.list_snapshots()  # a wrong one is a 401 the user reads
        self._controller = controller
        self._completer_reset()
        print(f"forkd: using {controller.base_url}")
        return controller

    def _completer_reset(self) -> None:
        completer = getattr(self, "completer", None)
        if completer is not None:
            completer.forget()


ForkdMagics.forkd.__doc__ = full_help()  # what %forkd? shows, as IPython shows any magic's docstring
