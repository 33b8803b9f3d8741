"""Running a cell of user code and reporting what it does as it does it.

A runner turns a cell into a stream of Jupyter-shaped events given to ``emit`` (``stream``,
``display_data``, ``execute_result``, ``error``...) and returns the reply content (``status``,
``execution_count``...). Two runners share this interface: the plain one here (the sandbox's own
namespace, no dependencies, for any snapshot) and the IPython shell (``shell.py``), used once a
sandbox has one (every sandbox of the forkd kernel does), for magics, rich display and comms.
"""

from __future__ import annotations

import ast
import base64
import builtins
import codeop
import contextlib
import io
import re
import rlcompleter
import threading
import traceback
from typing import Callable

from .executor import without_interrupt_frame

Emit = Callable[[dict], None]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def mime_bundle(obj) -> dict:
    """Jupyter-style representations of ``obj``: text/plain always, richer ones when offered."""
    data: dict = {}
    if hasattr(obj, "_repr_mimebundle_"):
        with contextlib.suppress(Exception):
            bundle = obj._repr_mimebundle_()
            if isinstance(bundle, tuple):
                bundle = bundle[0]
            data.update(bundle or {})
    for method, mime in (("_repr_html_", "text/html"), ("_repr_markdown_", "text/markdown"),
                         ("_repr_svg_", "image/svg+xml"), ("_repr_png_", "image/png"),
                         ("_repr_jpeg_", "image/jpeg"), ("_repr_json_", "application/json"),
                         ("_repr_latex_", "text/latex")):
        fn = getattr(obj, method, None)
        if callable(fn) and mime not in data:
            with contextlib.suppress(Exception):
                value = fn()
                if value is not None:
                    data[mime] = value
    for mime, value in list(data.items()):
        if isinstance(value, bytes):
            data[mime] = base64.b64encode(value).decode()
    data.setdefault("text/plain", repr(obj))
    return data


class EventStream(io.TextIOBase):
    """A text stream (stdout or stderr of a cell) that emits what is written, a moment later.

    Writes are gathered for at most ``delay`` seconds by one flusher thread, so a loop of prints is
    a few events, not thousands, and a line printed before a long computation still shows at once.
    """

    def __init__(self, name: str, emit: Emit, delay: float = 0.02, limit: int = 1 << 16):
        self.name, self._emit, self.delay, self.limit = name, emit, delay, limit
        self._parts: list[str] = []
        self._size = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    @property
    def encoding(self) -> str:
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        with self._lock:
            self._parts.append(text)
            self._size += len(text)
            full = self._size >= self.limit
            if not full and self._timer is None:
                self._timer = threading.Timer(self.delay, self.flush)
                self._timer.name = "forkd-flush"
                self._timer.daemon = True
                self._timer.start()
        if full:
            self.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            text = "".join(self._parts)
            self._parts, self._size = [], 0
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if text:
            self._emit({"type": "stream", "name": self.name, "text": text})


def traceback_lines(exc: BaseException, filename: str) -> list[str]:
    """The user's frames only: from the first frame of ``filename`` (the cell) on."""
    frames = traceback.extract_tb(without_interrupt_frame(exc.__traceback__))
    first = next((i for i, f in enumerate(frames) if f.filename == filename), len(frames))
    return (["Traceback (most recent call last):\n"] + traceback.format_list(frames[first:])
            + traceback.format_exception_only(type(exc), exc))


class NoStdin(RuntimeError):
    """input() in a cell whose caller cannot answer it."""


_ABSENT = object()


class PlainRunner:
    """Cells in the runtime's namespace: statements, then the last expression's value."""

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.execution_count = 0

    def execute(self, code: str, emit: Emit, *, execution_count: int | None = None,
                input_fn: Callable[[str, bool], str] | None = None, silent: bool = False,
                store_history: bool = True, user_expressions: dict | None = None, **_ignored) -> dict:
        if execution_count is not None:
            self.execution_count = execution_count
        elif store_history and not silent:
            self.execution_count += 1
        count = self.execution_count
        out, err = EventStream("stdout", emit), EventStream("stderr", emit)

        def display(*objs, **_kw):
            out.flush()  # what the cell printed before comes before the display, as in Jupyter
            err.flush()
            for obj in objs:
                emit({"type": "display_data", "data": mime_bundle(obj), "metadata": {}})

        def ask(prompt: str = "") -> str:
            if input_fn is None:
                raise NoStdin("input() is not available here: this cell runs without a console to answer it "
                              "(run it in the notebook's forkd kernel, or pass the value in the code)")
            out.flush()
            return input_fn(str(prompt), False)

        # for this cell only, as input below: left in the namespace, it shadowed IPython's display in
        # the notebook shell a checkout later puts on it, and sent to this cell's ended stream
        before = self.namespace.get("display", _ABSENT)
        self.namespace["display"] = display
        original_input = builtins.input
        builtins.input = ask
        reply: dict = {"status": "ok", "execution_count": count, "user_expressions": {}, "payload": []}
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                tree = ast.parse(code, "<cell>", "exec")
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                exec(compile(tree, "<cell>", "exec"), self.namespace)  # noqa: S102
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.namespace)  # noqa: S307
                    if value is not None:
                        self.namespace["_"] = value
                        if not silent:
                            out.flush()
                            emit({"type": "execute_result", "execution_count": count,
                                  "data": mime_bundle(value), "metadata": {}})
        except BaseException as exc:  # noqa: BLE001 - SystemExit in a cell must not end the agent
            error = {"ename": type(exc).__name__, "evalue": str(exc), "traceback": traceback_lines(exc, "<cell>")}
            out.flush()
            err.flush()
            emit({"type": "error", **error})
            reply.update(status="error", **error)
        finally:
            builtins.input = original_input
            if self.namespace.get("display") is display:  # unless the cell bound a display of its own
                if before is _ABSENT:
                    del self.namespace["display"]
                else:
                    self.namespace["display"] = before
            out.flush()
            err.flush()
        for name, expr in (user_expressions or {}).items():
            try:
                reply["user_expressions"][name] = {"status": "ok", "data": mime_bundle(eval(expr, self.namespace)),  # noqa: S307
                                                   "metadata": {}}
            except Exception as exc:  # noqa: BLE001
                reply["user_expressions"][name] = {"status": "error", "ename": type(exc).__name__,
                                                   "evalue": str(exc), "traceback": []}
        return reply

    def complete_request(self, code: str, cursor_pos: int | None = None) -> dict:
        pos = len(code) if cursor_pos is None else cursor_pos
        m = re.search(r"[\w.]*$", code[:pos])
        token = m.group(0) if m else ""
        completer = rlcompleter.Completer(self.namespace)
        matches, state = [], 0
        while len(matches) < 500:
            found = completer.complete(token, state)
            if found is None:
                break
            matches.append(found.rstrip("("))
            state += 1
        return {"status": "ok", "matches": sorted(set(matches)), "cursor_start": pos - len(token),
                "cursor_end": pos, "metadata": {}}

    def inspect(self, code: str, cursor_pos: int | None = None, detail_level: int = 0, **_ignored) -> dict:
        pos = len(code) if cursor_pos is None else cursor_pos
        m = re.search(r"[\w.]*$", code[:pos])
        name = (m.group(0) if m else "") + re.match(r"\w*", code[pos:]).group(0)
        try:
            obj = eval(name, self.namespace) if name else None  # noqa: S307 - the user's own namespace
        except Exception:  # noqa: BLE001
            return {"status": "ok", "found": False, "data": {}, "metadata": {}}
        text = f"{type(obj).__name__}: {obj!r}"
        doc = getattr(obj, "__doc__", None)
        if doc:
            text += "\n\n" + doc
        return {"status": "ok", "found": True, "data": {"text/plain": text}, "metadata": {}}

    def is_complete(self, code: str) -> dict:
        try:
            compiled = codeop.compile_command(code, "<cell>", "exec")
        except (SyntaxError, OverflowError, ValueError):
            return {"status": "invalid"}
        if compiled is None:
            return {"status": "incomplete", "indent": "    " if code.rstrip().endswith(":") else ""}
        return {"status": "complete"}


def collect(execute: Callable[[Emit], dict]) -> dict:
    """Run a cell and gather its events into one reply: the shape of the ``run_code`` action
    (``stdout``, ``stderr``, ``outputs``, ``result``, ``error``, ``exit_code``)."""
    stdout: list[str] = []
    stderr: list[str] = []
    outputs: list[dict] = []
    result = error = None

    def emit(event: dict) -> None:
        nonlocal result, error
        kind = event.get("type")
        if kind == "stream":
            (stdout if event.get("name") == "stdout" else stderr).append(event.get("text", ""))
        elif kind in ("display_data", "execute_result", "update_display_data"):
            outputs.append({"type": kind, "data": event.get("data", {})})
            if kind == "execute_result":
                result = event.get("data")
        elif kind == "error":
            error = {"ename": event.get("ename"), "evalue": event.get("evalue"),
                     "traceback": [ANSI.sub("", line) for line in event.get("traceback", [])]}

    reply = execute(emit)
    if reply.get("status") == "error" and error is None:
        error = {k: reply.get(k) for k in ("ename", "evalue", "traceback")}
    return {"stdout": "".join(stdout), "stderr": "".join(stderr), "outputs": outputs, "result": result,
            "error": error, "exit_code": 1 if error else 0}
