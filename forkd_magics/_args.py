"""The ``%forkd`` line: its subcommands' parsers (whose help is ``%forkd?``) and the shell-like rules
the line follows before parsing: a ``# comment`` outside quotes ends it, quotes are taken off.

IPython has already expanded ``{expr}`` and ``$name`` in the line (``var_expand``) when the magic
sees it; an expansion that failed is left as written, which ``_names.resolve`` turns into the error
Python would give.
"""

from __future__ import annotations

import argparse
import copy

from IPython.core import magic_arguments

from forkd_server.client import memory_limit_arg

A = magic_arguments.argument

# what each argument holds: completion and name resolution read it
SANDBOX_ARGS = {"sandbox", "sandboxes"}
TAG_OPTIONS = {"--tag", "-t"}
EVERYONE = A("--everyone", action="store_true", help="every notebook's, not only this notebook's")
# the sandboxes kill and run act on: named, every one of a snapshot, or all of this notebook's (or the server's)
TARGETS = (A("sandboxes", nargs="*", help="sandbox ids (or variables holding Sandbox objects or lists of them)"),
           A("--tag", "-t", default=None, help="every sandbox forked from this snapshot"),
           A("--all", action="store_true", help="every sandbox of this notebook"),
           A("--everyone", action="store_true", help="every sandbox on the server, every notebook's (--all is implied)"))


def strip_comment(line: str) -> str:
    """``line`` without its trailing ``# comment``: a ``#`` outside quotes at the start of a word
    starts it, as in a shell (``a#b`` stays a word, ``"# x"`` a string)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def unquote(value: str) -> str:
    """IPython splits magic lines without removing quotes: ``--setup "x = 1"`` means ``x = 1``."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _parser(name: str, doc: str, *arguments):
    """A magic_arguments parser for ``%forkd <name>``: ``arguments`` are ``argument(...)`` decorators."""
    def fn():
        pass
    fn.__doc__, fn.__name__ = doc, name
    for arg in reversed(arguments):
        fn = arg(fn)
    return magic_arguments.magic_arguments(name=f"forkd {name}")(fn)


SUBCOMMANDS = {
    "snapshot": _parser(
        "snapshot", "Create a snapshot: a warmed-up interpreter, frozen. As a cell magic "
                    "(%%forkd snapshot -t T) the cell is the setup code. Returns a Snapshot.",
        A("--tag", "-t", required=True, help="the snapshot's tag"),
        A("--setup", default=None, help="Python code run before the interpreter is frozen"),
        A("--engine", default="auto", help="auto, process or vm"),
        A("--mem-size-mib", type=int, default=None, help="memory size (VM engine)"),
        A("--disk-mib", type=int, default=None, help="an ext4 data disk at /data (VM engine)"),
        A("--package", action="append", default=None, metavar="DEB",
          help="a Debian package for the guest, e.g. python3-numpy (VM engine; repeatable)")),
    "fork": _parser(
        "fork", "Fork sandboxes (copy-on-write children). From a snapshot (--tag): n children of it. From a "
                "running sandbox (SB): a fork tree, n copies of its current state (%forkd keep picks the "
                "winner). In the forkd kernel, with neither, a fork tree of the notebook itself. Returns a "
                "list of Sandbox.",
        A("sandbox", nargs="?", default=None, help="a running sandbox to fork (its id or a variable holding it)"),
        A("--tag", "-t", default=None, help="the snapshot to fork from (a tag or a Snapshot variable)"),
        A("-n", type=int, default=1, help="how many sandboxes (default 1)"),
        A("--memory-limit-mib", type=memory_limit_arg, default=None, metavar="MIB|host",
          help="memory limit of each sandbox (host: all of its host's memory)"),
        A("--lossy", action="store_true", help="forking a sandbox or the notebook: go ahead even if running work "
                                               "(threads, child processes) stays behind, with a warning")),
    "branch": _parser(
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
    "keep": _parser(
        "keep", "Keep the winner of a fork tree (kids = %forkd fork -n 5; %forkd keep kids[2]): its siblings "
                "are killed and the tree's snapshot released if nothing needs it; what another notebook holds "
                "stays. In the forkd kernel the notebook moves into the winner first (as checkout). Returns "
                "the winner's Sandbox.",
        A("sandbox", help="the winner: a child of %%forkd fork (its id or a variable holding it)"),
        A("--keep-siblings", action="store_true", help="leave the siblings running; only close the tree")),
    "ls": _parser("ls", "List this notebook's snapshots and sandboxes (--everyone: all of them). Returns a "
                        "Listing (.snapshots, .sandboxes).", EVERYONE),
    "kill": _parser(
        "kill", "Kill sandboxes: by id or variable, every sandbox of a snapshot (--tag), all of this "
                "notebook's (--all) or all on the server (--everyone); never the notebook's own sandbox "
                "unless named. Kills what it can, then reports the ones it could not.",
        *TARGETS),
    "exec": _parser(
        "exec", "Run a command in a sandbox: %forkd exec SB -- cmd args. Returns a CommandResult.",
        A("sandbox", help="the sandbox id (or a variable holding a Sandbox)"),
        A("command", nargs="*", help="the command and its arguments (after --)"),
        A("--timeout", type=float, default=30, help="seconds (default 30)")),
    "delete": _parser(
        "delete", "Delete snapshots (their running sandboxes keep running): by tag, or all of this "
                  "notebook's (--all) or all on the server (--everyone), deepest first. A forkd kernel's base "
                  "snapshot goes only by name: --all and --everyone keep it and say so.",
        A("tags", nargs="*", help="snapshot tags (or variables holding Snapshot objects)"),
        A("--cascade", action="store_true", help="also delete the snapshots branched below each"),
        A("--all", action="store_true", help="every snapshot of this notebook"),
        A("--everyone", action="store_true", help="every snapshot on the server, every notebook's (--all is implied)")),
    "tree": _parser(
        "tree", "Show this notebook's lineage (--everyone: the whole server's) as a live widget. "
                "Returns the LineageWidget.",
        A("--static", action="store_true", help="do not follow live changes"), EVERYONE),
    "run": _parser(
        "run", "Cell magic: %%forkd run (SB ... | --tag T | --all) runs the cell in those sandboxes in "
               "parallel and shows their outputs side by side; the cell fails if it failed in any. "
               "Returns {sandbox id: Execution}.",
        *TARGETS,
        A("--timeout", type=float, default=None, help="seconds per sandbox"),
        A("--each", action="append", default=None, metavar="NAME=VALUES",
          help="give each sandbox its own value: NAME=EXPR, EXPR a list as long as the sandboxes, "
               "e.g. --each \"lr=[0.01, 0.1, 1.0]\"; the i-th sandbox runs NAME = EXPR[i] first "
               "(repeatable; values must be literals: numbers, strings, lists, dicts)")),
    "gather": _parser(
        "gather", "Evaluate EXPR in each sandbox and bind {sandbox id: value} to NAME in the notebook "
                  "(in the forkd kernel, in the notebook's sandbox). Values travel pickled.",
        A("sandboxes", nargs="+", help="sandbox ids (or variables holding Sandbox objects or lists of them)"),
        A("--expr", "-e", required=True, help="the Python expression evaluated in each sandbox"),
        A("--out", "-o", required=True, help="the name bound in the notebook")),
    "checkout": _parser(
        "checkout", "forkd kernel: run the next cells in another sandbox (its state), a fresh child of a "
                    "snapshot, or (-) where the notebook was before.",
        A("target", help="a sandbox (id or variable), a snapshot tag, or - for the previous one")),
    "head": _parser("head", "forkd kernel: the sandbox this notebook runs in, and its lineage."),
    "log": _parser("log", "forkd kernel: how the notebook got where it is: the cells run since each branch."),
    "push": _parser(
        "push", "Push a VM snapshot to the server's remote store (forkd serve --store URL): only the chunks "
                "the store lacks. Returns its digest (sha256:...), the snapshot's identity in any store.",
        A("tag", help="the snapshot's tag (or a variable holding a Snapshot)")),
    "pull": _parser(
        "pull", "Make a snapshot on the server from its remote store, by tag or --digest: only the chunks "
                "the server lacks are fetched, each verified. Returns a Snapshot.",
        A("tag", nargs="?", default=None, help="the snapshot's tag in the store"),
        A("--digest", default=None, help="the snapshot's digest, sha256:...")),
    "freeze": _parser(
        "freeze", "Pause a sandbox: its memory kept, no CPU used (tier frozen). Any call wakes it (a cell "
                  "run in it, exec, branch), same id, state intact.",
        A("sandbox", help="the sandbox id (or a variable holding a Sandbox)")),
    "store": _parser(
        "store", "Write a VM sandbox's state to the store and end its process (tier stored: no process, no "
                 "RAM; pushed too when the server has a remote store). Any call wakes it, same id, state "
                 "intact. On the process engine frozen is the deepest tier.",
        A("sandbox", help="the sandbox id (or a variable holding a Sandbox)")),
    "wake": _parser(
        "wake", "Make a frozen or stored sandbox run again now (any call would wake it) and say how long it "
                "took; from stored, split into fetch, decompress and restore.",
        A("sandbox", help="the sandbox id (or a variable holding a Sandbox)")),
    "connect": _parser(
        "connect", "Use another server (default: $FORKD_URL, else the server found on this host). The "
                   "token comes from $FORKD_TOKEN, else a prompt that does not echo: never from the line, "
                   "which the notebook would keep.",
        A("url", nargs="?", default=None, help="the server's URL, e.g. http://127.0.0.1:8889")),
}

HELP = """Fork-on-write Python sandboxes from a notebook.

  %forkd snapshot -t py --setup "import numpy as np"     -> Snapshot
  %forkd fork -t py -n 4                                  -> [Sandbox, ...]
  %forkd branch SB [-t TAG] [--diff|--live] [--no-wait]   -> Snapshot
  In the "Python 3 (forkd)" kernel, the notebook itself:
  %forkd branch --live | fork -n 5 | checkout SB|TAG|- | head | log
  kids = %forkd fork [SB] -n 5; %forkd keep kids[2]      -> a fork tree; keep one, drop the rest
  %forkd ls | kill (SB ... | -t TAG | --all | --everyone) | delete (TAG ... | --all | --everyone)
  %forkd exec SB -- cmd | tree | connect URL
  %forkd push TAG | pull (TAG | --digest D)               -> a remote store (forkd serve --store URL)
  %forkd freeze SB | store SB | wake SB                   -> tiers: no CPU, then no RAM; a call wakes it
  %%forkd run (SB ... | -t TAG | --all)                   -> runs the cell in each, side by side

ls, tree and --all mean this notebook's snapshots and sandboxes (labelled with its path and kernel
id); --everyone means the whole server's. A # starts a comment; {expr} and $name are expanded;
an argument naming a variable takes its value (a Sandbox, a list of them, a Snapshot).

Subcommands:

"""


class _PlainFormatter(argparse.HelpFormatter):
    """argparse's own help, as a person reads it: IPython's formatter writes reST (``::`` blocks and
    ``<ARG>``) for Sphinx, which ``%forkd?`` and ``%forkd help`` would show raw."""

    def __init__(self, prog: str, magic: str = "%"):
        super().__init__(prog, width=100, max_help_position=30)
        self.magic = magic

    def add_usage(self, usage, actions, groups, prefix=None):
        super().add_usage(usage, actions, groups, self.magic if prefix is None else prefix)


def plain_help(sub: str) -> str:
    """``%forkd SUB --help``: the usage line, what it does (wrapped) and its options."""
    parser = copy.copy(SUBCOMMANDS[sub].parser)
    magic = "%%" if sub == "run" else "%"  # run is a cell magic
    parser.formatter_class = lambda prog: _PlainFormatter(prog, magic)
    return parser.format_help()


def full_help() -> str:
    """``%forkd help`` and ``%forkd?``: the overview, then every subcommand's help."""
    return HELP + "\n".join(plain_help(sub) for sub in SUBCOMMANDS)


def options(sub: str) -> list[str]:
    """Every option string of a subcommand (for completion)."""
    parser = SUBCOMMANDS[sub].parser
    return [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]


def positional(sub: str) -> str | None:
    """The name of a subcommand's positional argument (``sandboxes``, ``tag``...), if any."""
    parser = SUBCOMMANDS[sub].parser
    return next((a.dest for a in parser._actions if not a.option_strings), None)
