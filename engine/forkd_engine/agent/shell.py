"""The IPython shell that is a notebook's namespace when the forkd kernel drives this sandbox.

An ``InteractiveShell`` without a terminal and without threads (its history database is off: a
fork keeps no thread but the one that forks), whose display publisher, display hook, streams,
``input()``/``getpass`` and comms send events to the attached session instead of a terminal or a
ZeroMQ socket, the way JupyterLite's kernel runs IPython where no ipykernel can run. Its user
namespace is the runtime's, so ``eval``, ``run_code`` and the notebook see the same variables, and
every fork of the sandbox carries the shell, its counter and its widgets' state with it.
"""

from __future__ import annotations

import base64
import builtins
import getpass
import os
import subprocess
import sys

from IPython.core import page, payloadpage
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.display_trap import DisplayTrap
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.tokenutil import token_at_cursor
from traitlets.config import Config

from .cells import EventStream, NoStdin
from .executor import without_interrupt_frame


def jsonable(value):
    """What IPython's formatters return, made JSON: bytes (images) as base64, the rest as is or repr."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


class _Publisher(DisplayPublisher):
    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
        self.shell.emit_event({"type": "update_display_data" if update else "display_data",
                               "data": jsonable(data), "metadata": jsonable(metadata or {}),
                               "transient": jsonable(transient or {})})

    def clear_output(self, wait=False) -> None:
        self.shell.emit_event({"type": "clear_output", "wait": bool(wait)})


class _DisplayHook(DisplayHook):
    """The value of a cell's last expression becomes an ``execute_result``."""

    def start_displayhook(self) -> None:
        self._result = {"type": "execute_result", "data": {}, "metadata": {}}

    def write_output_prompt(self) -> None:
        self._result["execution_count"] = self.prompt_count

    def write_format_data(self, format_dict, md_dict=None) -> None:
        self._result["data"] = jsonable(format_dict)
        self._result["metadata"] = jsonable(md_dict or {})

    def finish_displayhook(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if self._result.get("data"):
            self.shell.emit_event(self._result)
        self._result = {}


def _install_comms(shell: "ForkdShell") -> None:
    """Comms (ipywidgets) whose messages are session events; a guest without the ``comm`` package
    (an old Debian IPython) simply has none."""
    try:
        import comm
        from comm.base_comm import BaseComm, CommManager
    except ImportError:
        shell.comm_manager = None
        return

    class ForkdComm(BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys) -> None:
            content = jsonable(dict(data=data or {}, comm_id=self.comm_id, **keys))
            shell.emit_event({"type": msg_type, "content": content, "metadata": jsonable(metadata or {}),
                              "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in buffers or []]})

    shell.comm_manager = CommManager()
    comm.create_comm = lambda **kwargs: ForkdComm(**kwargs)
    comm.get_comm_manager = lambda: shell.comm_manager


def _msg(message: dict, msg_type: str) -> dict:
    """A Jupyter message as CommManager handlers expect it, from a session message."""
    return {"header": {"msg_type": msg_type}, "parent_header": {}, "metadata": message.get("metadata") or {},
            "content": message.get("content") or {},
            "buffers": [base64.b64decode(b) for b in message.get("buffers") or []]}


class ForkdShell(InteractiveShell):
    """The shell. ``start(runtime)`` makes the one of this sandbox (IPython's singleton)."""

    @classmethod
    def start(cls, runtime) -> "ForkdShell":
        config = Config()
        config.HistoryManager.enabled = False   # no SQLite thread (a fork keeps only one thread)
        config.InteractiveShell.colors = "Linux"
        os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        os.environ.setdefault("TERM", "xterm-color")
        os.environ.setdefault("CLICOLOR", "1")
        shell = cls.instance(config=config, user_ns=runtime.namespace)
        shell.runtime = runtime
        shell.set_hook("show_in_pager", page.as_hook(payloadpage.page), 99)
        _install_comms(shell)
        shell.warm()
        return shell

    # --- wiring ----------------------------------------------------------------------------------

    def init_display_pub(self) -> None:
        self.display_pub = _Publisher(shell=self, parent=self)
        self.configurables.append(self.display_pub)

    def init_displayhook(self) -> None:
        self.displayhook = _DisplayHook(shell=self, cache_size=self.cache_size)
        self.configurables.append(self.displayhook)
        self.display_trap = DisplayTrap(hook=self.displayhook)  # swapped into sys.displayhook per cell

    def init_io(self) -> None:
        pass  # no terminal: the streams are the session's, installed when one attaches

    def init_virtualenv(self) -> None:
        pass

    def enable_gui(self, gui=None):
        raise NotImplementedError("GUI event loops are not available in a sandbox (no display)")

    session = None          # the session that hears what happens between requests
    _sink = None            # where the request being run sends its events
    _stdout = _stderr = None

    def emit_event(self, event: dict) -> None:
        sink = self._sink
        if sink is not None:
            sink(event)
        elif self.session is not None:
            self.session.emit(event, None)

    def attach(self, session) -> None:
        """``session`` now hears background output and comm traffic between requests."""
        self.session = session
        if self._stdout is None:
            self._stdout = EventStream("stdout", self.emit_event)
            self._stderr = EventStream("stderr", self.emit_event)
        sys.stdout, sys.stderr = self._stdout, self._stderr

    def detach(self, session) -> None:
        if self.session is session:
            self.session = None

    def after_fork(self) -> None:
        self.session = self._sink = None

    def warm(self) -> None:
        """Load now what the first completion and the first cell would load in every fork."""
        self.run_cell("pass", store_history=False, silent=True)
        self.complete_request("import o", 8)
        self.execution_count = 1

    # --- requests --------------------------------------------------------------------------------

    def execute(self, code: str, emit, *, silent: bool = False, store_history: bool = True,
                user_expressions: dict | None = None, execution_count: int | None = None,
                input_fn=None, session=None, **_ignored) -> dict:
        if execution_count is not None:
            self.execution_count = int(execution_count)
        count = self.execution_count
        self._last_error = None
        self._sink = emit
        saved = builtins.input, getpass.getpass
        builtins.input = lambda prompt="": self._ask(input_fn, prompt, False)
        getpass.getpass = lambda prompt="Password: ", stream=None: self._ask(input_fn, prompt, True)
        if session is not None and self.session is None:
            self.attach(session)
        try:
            result = self.run_cell(code, store_history=store_history, silent=silent)
        finally:
            builtins.input, getpass.getpass = saved
            for stream in (self._stdout, self._stderr):
                if stream is not None:
                    stream.flush()
            self._sink = None
        payload = self.payload_manager.read_payload()
        self.payload_manager.clear_payload()
        reply = {"status": "ok", "execution_count": count, "payload": jsonable(payload),
                 "user_expressions": jsonable(self.user_expressions(user_expressions or {}))}
        if not result.success:
            error = self._last_error or {"ename": "UnknownError", "evalue": "", "traceback": []}
            reply.update(status="error", **error)
        return reply

    @staticmethod
    def _ask(input_fn, prompt, password: bool) -> str:
        if input_fn is None:
            raise NoStdin("input() is not available here: the caller of this cell cannot answer it")
        sys.stdout.flush()
        return input_fn(str(prompt), password)

    def _get_exc_info(self, exc_tuple=None):
        etype, value, tb = super()._get_exc_info(exc_tuple)
        return etype, value, without_interrupt_frame(tb)

    def _showtraceback(self, etype, evalue, stb) -> None:
        self._last_error = {"ename": getattr(etype, "__name__", str(etype)), "evalue": str(evalue),
                            "traceback": list(stb)}
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.emit_event({"type": "error", **self._last_error})

    def system_piped(self, cmd):
        """``!cmd``: run it in a shell, its output streamed into the cell."""
        cmd = self.var_expand(cmd, depth=1)
        sys.stdout.flush()
        proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                executable=os.environ.get("SHELL") or "/bin/sh")
        try:
            for line in iter(proc.stdout.readline, b""):
                sys.stdout.write(line.decode("utf-8", "replace"))
            code = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        finally:
            proc.stdout.close()
        self.user_ns["_exit_code"] = code

    system = system_raw = system_piped

    def complete_request(self, code: str, cursor_pos: int | None = None) -> dict:
        from IPython.core.completer import provisionalcompleter
        pos = len(code) if cursor_pos is None else cursor_pos
        with provisionalcompleter():
            found = list(self.Completer.completions(code, pos))
        matches = [c.text for c in found]
        start = min((c.start for c in found), default=pos)
        end = max((c.end for c in found), default=pos)
        types = [{"start": c.start, "end": c.end, "text": c.text, "type": c.type, "signature": c.signature}
                 for c in found]
        return {"status": "ok", "matches": matches, "cursor_start": start, "cursor_end": end,
                "metadata": {"_jupyter_types_experimental": types}}

    def inspect(self, code: str, cursor_pos: int | None = None, detail_level: int = 0,
                omit_sections=(), **_ignored) -> dict:
        name = token_at_cursor(code, len(code) if cursor_pos is None else cursor_pos)
        try:
            bundle = self.object_inspect_mime(name, detail_level=detail_level, omit_sections=tuple(omit_sections))
            if not self.enable_html_pager:
                bundle.pop("text/html", None)
            return {"status": "ok", "found": True, "data": jsonable(bundle), "metadata": {}}
        except KeyError:
            return {"status": "ok", "found": False, "data": {}, "metadata": {}}

    def is_complete(self, code: str) -> dict:
        status, indent = self.input_transformer_manager.check_complete(code)
        reply = {"status": status}
        if status == "incomplete":
            reply["indent"] = " " * (indent or 0)
        return reply

    # --- comms (ipywidgets) ----------------------------------------------------------------------

    def comm_info(self, message: dict, session) -> dict:
        if self.comm_manager is None:
            return {"status": "ok", "comms": {}}
        target = (message.get("content") or {}).get("target_name", message.get("target_name"))
        comms = {cid: {"target_name": c.target_name} for cid, c in self.comm_manager.comms.items()
                 if target is None or c.target_name == target}
        return {"status": "ok", "comms": comms}

    def _comm(self, kind: str, message: dict, session) -> None:
        if self.comm_manager is None:
            return None
        if self.session is None:
            self.attach(session)
        getattr(self.comm_manager, kind)(None, None, _msg(message, kind))
        for stream in (self._stdout, self._stderr):
            if stream is not None:
                stream.flush()
        return None

    def comm_open(self, message: dict, session) -> None:
        return self._comm("comm_open", message, session)

    def comm_msg(self, message: dict, session) -> None:
        return self._comm("comm_msg", message, session)

    def comm_close(self, message: dict, session) -> None:
        return self._comm("comm_close", message, session)


__all__ = ["ForkdShell", "jsonable"]
