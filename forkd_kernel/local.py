"""The kernel's own side: ``%forkd`` lines run here, between the notebook's cells.

A line like ``kids = %forkd fork -n 5`` acts *on* the notebook's sandbox, so it cannot run inside
it: it runs in a small IPython shell in the kernel process, whose namespace holds what those lines
bind (``kids``). ``KernelMagics`` are the ``%forkd`` magics with the notebook's HEAD filled in:
``branch`` and ``fork`` with no target act on HEAD, ``checkout`` moves it (so does ``keep``, into
the winner), ``head`` and ``log`` tell where it is and how it got there.
"""

from __future__ import annotations

import ast
import re
import time
from typing import Callable

from IPython.core import page, payloadpage
from IPython.core.completer import provisionalcompleter
from IPython.core.display_trap import DisplayTrap
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.inputtransformer2 import TransformerManager
from traitlets.config import Config

from forkd_magics._errors import show_details
from forkd_magics._magics import ForkdMagics
from forkd_server.client import ControllerError, Sandbox, Snapshot

from .head import HeadGone

__all__ = ["LocalShell", "KernelMagics", "is_forkd_cell", "on_forkd_line", "with_forkd_magic"]

_transformer = TransformerManager()
# A line that is a %forkd / %%forkd magic, or binds one's result (``kids = %forkd fork -n 5``), or
# asks for its help (``%forkd?``, ``?%forkd``).
_FORKD_LINE = re.compile(r"(?:^|\n)[ \t]*(?:\w+[ \t]*=[ \t]*)?\??%%?forkd\b")
# A magic's name being typed at the end of a line (``%fo``, ``kids = %%f``).
_TYPING_MAGIC = re.compile(r"(?:^|\n)[ \t]*(?:\w+[ \t]*=[ \t]*)?(%%?\w*)\Z")
# A sandbox id or snapshot tag as the server accepts them: `%forkd checkout good-run` means the tag,
# though it also parses as an expression over names the kernel does not have.
_ID_OR_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")


def is_forkd_cell(code: str) -> bool:
    """True when every statement of the cell is a ``%forkd``/``%%forkd`` magic (or binds one's result).
    A cell that mixes them with Python is refused: the two run in different places."""
    if not _FORKD_LINE.search(code):
        return False
    try:
        tree = ast.parse(_transformer.transform_cell(code))
    except SyntaxError:
        return False
    statements = tree.body
    forkd = [s for s in statements if _is_forkd_call(s)]
    if statements and len(forkd) == len(statements):
        return True
    if forkd:
        raise UsageError("a cell with %forkd lines runs in the kernel, between the notebook's cells, while Python "
                         "runs in the notebook's sandbox\nput the %forkd lines in a cell of their own")
    return False


def on_forkd_line(code: str, cursor_pos: int) -> bool:
    """Is the cursor on a ``%forkd`` line? It completes here, where the names it takes live."""
    return bool(_FORKD_LINE.match(code[:cursor_pos].rsplit("\n", 1)[-1]))


def with_forkd_magic(reply: dict, code: str, cursor_pos: int) -> dict:
    """The sandbox's completion reply, plus ``%forkd`` / ``%%forkd`` where a magic's name is being
    typed: the sandbox's shell has no such magic, the kernel has."""
    m = _TYPING_MAGIC.search(code[:cursor_pos])
    if m is None:
        return reply
    typed, first_line = m.group(1), "\n" not in code[:m.start(1)]
    names = [n for n in ("%forkd", "%%forkd") if n.startswith(typed) and (first_line or n == "%forkd")]
    start = cursor_pos - len(typed)
    theirs = reply.get("cursor_start", start)
    if not names or not start <= theirs <= cursor_pos or reply.get("cursor_end", cursor_pos) != cursor_pos:
        return reply
    # The sandbox's matches replace [theirs, cursor); widened to [start, cursor) with what lies between.
    between = code[start:theirs]
    metadata = dict(reply.get("metadata") or {})
    if "_jupyter_types_experimental" in metadata:  # kept in step with the matches
        metadata["_jupyter_types_experimental"] = [
            *({"start": start, "end": cursor_pos, "text": n, "type": "magic"} for n in names),
            *({**t, "start": start, "text": between + t.get("text", "")} for t in metadata["_jupyter_types_experimental"])]
    return {**reply, "status": "ok", "matches": [*names, *(between + m for m in reply.get("matches", []))],
            "metadata": metadata, "cursor_start": start, "cursor_end": cursor_pos}


def _is_forkd_call(stmt: ast.stmt) -> bool:
    """A %forkd / %%forkd line, or ``%forkd?`` (IPython's ``pinfo`` of the magic: its help lives here)."""
    value = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr in ("run_line_magic", "run_cell_magic")):
        return False
    args = [a.value if isinstance(a, ast.Constant) else None for a in value.args]
    return args[:1] == ["forkd"] or (args[:1] in (["pinfo"], ["pinfo2"]) and args[1:2] in (["%forkd"], ["%%forkd"]))


class _Publisher(DisplayPublisher):
    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
        self.shell.publish("update_display_data" if update else "display_data",
                           {"data": data, "metadata": metadata or {}, "transient": transient or {}})

    def clear_output(self, wait=False) -> None:
        self.shell.publish("clear_output", {"wait": bool(wait)})


class _DisplayHook(DisplayHook):
    def start_displayhook(self) -> None:
        self._content = {"data": {}, "metadata": {}}

    def write_output_prompt(self) -> None:
        self._content["execution_count"] = self.prompt_count

    def write_format_data(self, format_dict, md_dict=None) -> None:
        self._content["data"], self._content["metadata"] = format_dict, md_dict or {}

    def finish_displayhook(self) -> None:
        if self._content.get("data"):
            self.shell.publish("execute_result", self._content)


class LocalShell(InteractiveShell):
    """A terminal-less shell whose display goes to the kernel's IOPub through ``publish``."""

    publish: Callable[[str, dict], None] = staticmethod(lambda msg_type, content: None)
    last_error: dict | None = None

    @classmethod
    def make(cls, publish: Callable[[str, dict], None]) -> "LocalShell":
        config = Config()
        config.HistoryManager.enabled = False
        config.InteractiveShell.colors = "Linux"
        shell = cls.instance(config=config)
        shell.publish = publish
        shell.set_hook("show_in_pager", page.as_hook(payloadpage.page), 99)  # %forkd?: a pager payload, as ipykernel
        return shell

    def init_display_pub(self) -> None:
        self.display_pub = _Publisher(shell=self, parent=self)
        self.configurables.append(self.display_pub)

    def init_displayhook(self) -> None:
        self.displayhook = _DisplayHook(shell=self, cache_size=self.cache_size)
        self.configurables.append(self.displayhook)
        self.display_trap = DisplayTrap(hook=self.displayhook)

    def init_io(self) -> None:
        pass

    def init_virtualenv(self) -> None:
        pass

    def complete_reply(self, code: str, cursor_pos: int) -> dict:
        """A ``complete_reply`` from this shell's completer (``%forkd`` lines: forkd_magics' own)."""
        with provisionalcompleter():
            found = list(self.Completer.completions(code, cursor_pos))
        return {"status": "ok", "matches": [c.text for c in found], "metadata": {},
                "cursor_start": min((c.start for c in found), default=cursor_pos),
                "cursor_end": max((c.end for c in found), default=cursor_pos)}

    def inspect_reply(self, code: str, cursor_pos: int, detail_level: int = 0) -> dict:
        """An ``inspect_reply`` on a ``%forkd`` line: the magic's help, as ipykernel gives a magic's."""
        line = code[:cursor_pos].rsplit("\n", 1)[-1]
        name = "%%forkd" if "%%forkd" in line else "%forkd"
        return {"status": "ok", "found": True, "metadata": {},
                "data": self.object_inspect_mime(name, detail_level=detail_level)}

    def show_usage_error(self, exc) -> None:
        self.last_error = {"ename": "UsageError", "evalue": str(exc), "traceback": [f"\x1b[0;31mUsageError\x1b[0m: {exc}"]}
        self.publish("error", self.last_error)

    def _showtraceback(self, etype, evalue, stb) -> None:
        self.last_error = {"ename": getattr(etype, "__name__", str(etype)), "evalue": str(evalue), "traceback": list(stb)}
        self.publish("error", self.last_error)


class HeadInfo:
    """What ``%forkd head`` returns: HEAD's sandbox, the snapshots it descends from, its engine, and
    where ``%forkd checkout -`` goes (a sandbox that still runs)."""

    def __init__(self, sandbox: dict, way_back: str | None):
        self.sandbox, self.way_back = sandbox, way_back

    @property
    def id(self) -> str:
        return self.sandbox["id"]

    @property
    def tier(self) -> str:
        """running, frozen (paused while the notebook idles) or stored (in the store, no RAM)."""
        return self.sandbox.get("tier") or "running"

    def __repr__(self) -> str:
        lineage = " → ".join(self.sandbox.get("lineage") or [])
        lines = [f"HEAD {self.id} ({self.sandbox.get('engine')}, {self.tier}, forked from "
                 f"{self.sandbox.get('snapshot_tag')})",
                 f"lineage: {lineage}"]
        if self.way_back:
            lines.append(f"%forkd checkout - goes back to {self.way_back}")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


class Log:
    """What ``%forkd log`` returns: HEAD's lineage, newest first, with the cells run in each sandbox."""

    def __init__(self, lineage: list[str], cells: list[dict], snapshots: dict[str, dict], head: str,
                 gone: set[str] = frozenset()):
        self.lineage, self.cells, self.snapshots, self.head, self.gone = lineage, cells, snapshots, head, gone

    def lines(self) -> list[str]:
        by_sandbox: dict[str, list[dict]] = {}
        for c in self.cells:
            by_sandbox.setdefault(c.get("sandbox") or "?", []).append(c)
        out = []
        for name in reversed(self.lineage):
            if name in self.snapshots or not name.startswith("sb-"):
                info = self.snapshots.get(name) or {}
                pause = info.get("pause_ms")
                out.append(f"  snapshot {name}" + (f"  (paused its source {pause} ms)" if pause is not None else "")
                           + ("" if name in self.snapshots else "  (deleted)"))
                continue
            out.append(f"* {name}" + ("  ← HEAD" if name == self.head else "  (gone)" if name in self.gone else ""))
            for c in by_sandbox.get(name, []):
                first = (c.get("code") or "").strip().splitlines() or [""]
                when = time.strftime("%H:%M:%S", time.localtime(c.get("time") or 0))
                number = f"[{c['n']}]" if c.get("n") is not None else "[·]"  # · : run by %%forkd run or the API
                out.append(f"    {number} {when}  {first[0][:100]}" + (" …" if len(first) > 1 else ""))
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


class KernelMagics(ForkdMagics):  # no @magics_class: it would drop the inherited %forkd
    """``%forkd`` in the forkd kernel: HEAD is the notebook's own sandbox."""

    def __init__(self, shell, kernel):
        super().__init__(shell, controller=kernel.controller)
        self.kernel = kernel

    def head(self) -> str | None:
        return self.kernel.head_id()

    def bind_in_notebook(self, name: str, value) -> None:
        """The notebook's code runs in HEAD: the value goes there (pickled), not into the kernel."""
        import base64
        import pickle
        payload = base64.b64encode(pickle.dumps(value)).decode()
        code = f"{name} = __import__('pickle').loads(__import__('base64').b64decode({payload!r}))"
        reply = self.kernel.head.request("execute", code=code, silent=True, store_history=False, timeout=300)
        if reply.get("status") != "ok":
            raise UsageError(f"forkd: could not bind {name} in the notebook's sandbox: {reply.get('evalue')}")

    def head_memory_limit_mib(self) -> int | None:
        return self.kernel.memory_limit_mib

    def before_keep(self, winner: str) -> None:
        """``%forkd keep``: the notebook moves into the winner before its siblings go (one of them
        may be HEAD now), as ``%forkd checkout`` moves it."""
        if winner != self.kernel.head_id():
            try:
                self.kernel.checkout(winner)
            except UsageError as exc:  # said as the line the user ran
                raise UsageError(re.sub(r"^forkd checkout:", "forkd keep:", str(exc))) from None

    def _checkout(self, args, cell):
        target = args.target
        if target != "-":
            value = self.shell.user_ns.get(target, target) if target.isidentifier() else None
            if value is None:
                try:
                    value = eval(target, self.shell.user_ns)  # noqa: S307 - the user's own kernel namespace
                except SyntaxError:
                    value = target  # an id or a tag
                except Exception as exc:  # noqa: BLE001 - e.g. good-run, read as good minus run
                    if not _ID_OR_TAG.match(target):
                        raise UsageError(f"forkd checkout: {exc} (in the kernel, where %forkd lines bind names)") from None
                    value = target
            if isinstance(value, (list, tuple)) and len(value) == 1:
                value = value[0]
            if isinstance(value, Sandbox):
                target = value.id
            elif isinstance(value, Snapshot):
                target = value.tag
            elif isinstance(value, str):
                target = value
            else:
                raise UsageError(f"forkd checkout: {args.target} is a {type(value).__name__}, not a sandbox or snapshot")
        return self.kernel.checkout(target)

    def _head_info(self, sub: str) -> dict:
        """HEAD's sandbox as the server has it; a HEAD that is gone is said as the next cell says it."""
        sandbox = self.kernel.head_id()
        if sandbox is None:
            raise UsageError(f"forkd {sub}: this notebook has no sandbox (see the kernel's first message)")
        try:
            return self.controller.get_sandbox(sandbox)
        except ControllerError as exc:
            if exc.status != 404:
                raise
            ended = (exc.body.get("ended") if isinstance(exc.body, dict) else None) or {}
            raise self._gone(sub, self.kernel.head.gone(ended.get("reason"), (exc.hint, exc.details))) from None

    def _gone(self, sub: str, gone: HeadGone) -> UsageError:
        """HEAD is gone, said as the next cell says it: two lines, the details collapsed under them."""
        error = UsageError(f"forkd {sub}: {gone}")
        error.details = gone.details
        show_details(self.shell, gone.details)
        return error

    def _head(self, args, cell):
        return HeadInfo(self._head_info("head"), self.kernel.way_back())

    def _log(self, args, cell):
        info = self._head_info("log")
        sandbox = info["id"]
        try:
            cells = self.kernel.head.request("history", hist_access_type="tail", n=10_000, detail=True)
        except HeadGone as exc:
            raise self._gone("log", exc) from None
        snapshots = {s["tag"]: s for s in self.controller.list_snapshots()}
        lineage = info.get("lineage") or []
        gone = {n for n in lineage if n.startswith("sb-") and n != sandbox and not self.kernel.is_running(n)}
        return Log(lineage, cells.get("entries") or [], snapshots, sandbox, gone)
