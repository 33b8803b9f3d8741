"""``ForkdKernel``: the Jupyter kernel "Python 3 (forkd)". The notebook's namespace is an IPython
shell inside a forkd sandbox (HEAD); this kernel is the thin local end of it.

Cells go to HEAD over one streaming session and their output comes back as it happens: stdout,
rich display, errors, ``input()``, widgets (comms are routed by id: the kernel's own, such as the
lineage widget, stay here; the sandbox's go there), completion, inspection. ``%forkd`` cells run
here, between cells, so a branch or fork always copies an idle shell; ``%forkd checkout`` moves
HEAD. The kernel owns the execution counter, so it goes on across fork and checkout.

Never silently fresh: if HEAD's sandbox dies, the next cell is an error naming it. A kernel restart
starts in a fresh child of the base snapshot and says where the previous HEAD still runs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import signal
import sys
import threading

from IPython.core.error import UsageError
from ipykernel.kernelbase import Kernel
from traitlets import Enum, Float, Integer, List, Unicode, Union, default

from forkd_magics._complete import install as install_completer
from forkd_magics._errors import Explained, details_bundle, explained
from forkd_magics._magics import spawn_when_written
from forkd_magics._names import as_python, sandbox_ids
from forkd_magics._scope import Scope, kernel_id, notebook_path
from forkd_server.client import BadServerURL, Controller, ControllerError, ServerUnreachable
from forkd_server.client._core import DEFAULT_URL

from . import __version__
from .base import BaseSnapshot
from .head import Head, HeadGone
from .idle import IdleTiers
from .local import KernelMagics, LocalShell, is_forkd_cell, on_forkd_line, with_forkd_magic
from .ownership import make_ours

REPLIES = ("status", "interrupt_reply", "session_reply")
INTERRUPTED = object()  # on a cell's event queue: the frontend's Interrupt (SIGINT) reached the kernel


@contextlib.contextmanager
def sigint_handled_by(handler):
    """SIGINT (the frontend's Interrupt) handled by ``handler`` meanwhile. Where a cell runs in the
    sandbox: ``events.put(INTERRUPTED)`` on its event queue, not a KeyboardInterrupt, which, raised
    wherever the kernel was (forwarding the cell's output, say), escaped the cell: it ran on and its
    reply was never sent. The queue is a ``SimpleQueue``, whose ``put`` may run inside its own
    ``get``, as a signal handler does. Signals reach the main thread only: elsewhere, no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _env_list(name: str) -> list[str]:
    return [p.strip() for p in os.environ.get(name, "").replace(",", " ").split() if p.strip()]


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not a number of seconds") from None
    if seconds < 0:
        raise ValueError(f"${name}={value!r}: seconds cannot be negative (0 turns the move off)")
    return seconds


class ForkdKernel(Kernel):
    implementation = "forkd"
    implementation_version = __version__
    banner = (f"Python {sys.version.split()[0]} in a forkd sandbox: %forkd branch --live, "
              f"kids = %forkd fork -n 5, %forkd checkout SB|TAG|-, %forkd head, %forkd log")
    language_info = {
        "name": "python", "version": sys.version.split()[0], "mimetype": "text/x-python",
        "codemirror_mode": {"name": "ipython", "version": 3}, "pygments_lexer": "ipython3",
        "nbconvert_exporter": "python", "file_extension": ".py",
    }
    help_links = [{"text": "forkd kernel", "url": "https://github.com/forkd-jupyter/forkd-jupyter#the-forkd-kernel"}]

    engine = Unicode(config=True, help="Engine of the notebook's sandboxes: process, vm or auto ($FORKD_KERNEL_ENGINE; "
                                       "auto: process, unless the setup leaves running work a fork cannot carry, "
                                       "then vm).")
    setup = Unicode(config=True, help="Python run once in the base snapshot ($FORKD_KERNEL_SETUP).")
    packages = List(Unicode(), config=True, help="Debian packages for a vm base ($FORKD_KERNEL_PACKAGES).")
    base_snapshot = Unicode(config=True, help="Fork the notebook from this snapshot ($FORKD_KERNEL_BASE); "
                                              "default: one made for these settings, shared by every kernel.")
    memory_limit_mib = Union([Integer(min=16), Enum(["host"])], config=True,
                             help="Memory limit (MiB) of the notebook's sandboxes: HEAD, the children checkout "
                                  "makes, %forkd fork of HEAD, the base's setup ($FORKD_KERNEL_MEMORY_LIMIT_MIB; "
                                  "default: \"host\", all the memory of the host the sandbox runs on, which the "
                                  "server resolves, since the pages a notebook shares with the branches it keeps "
                                  "stay charged to it).")

    freeze_after = Float(config=True, help="Seconds the notebook idles before its sandbox is frozen: paused, no CPU "
                                           "($FORKD_KERNEL_FREEZE_AFTER; default 600; 0: never). The next cell "
                                           "wakes it.")
    store_after = Float(config=True, help="Seconds the notebook idles before its sandbox is stored: its state "
                                          "written to the store, its VM ended, no RAM held ($FORKD_KERNEL_STORE_AFTER; "
                                          "default 3600; 0: never). VM engine only: a process sandbox stays frozen. "
                                          "The next cell wakes it, state intact, and says how long that took.")

    @default("freeze_after")
    def _freeze_after(self) -> float:
        return _env_seconds("FORKD_KERNEL_FREEZE_AFTER", 600.0)

    @default("store_after")
    def _store_after(self) -> float:
        return _env_seconds("FORKD_KERNEL_STORE_AFTER", 3600.0)

    @default("engine")
    def _engine(self) -> str:
        return os.environ.get("FORKD_KERNEL_ENGINE", "auto")

    @default("setup")
    def _setup(self) -> str:
        return os.environ.get("FORKD_KERNEL_SETUP", "")

    @default("packages")
    def _packages(self) -> list:
        return _env_list("FORKD_KERNEL_PACKAGES")

    @default("base_snapshot")
    def _base(self) -> str:
        return os.environ.get("FORKD_KERNEL_BASE", "")

    @default("memory_limit_mib")
    def _memory_limit(self) -> int | str:
        # "host": the server that runs the sandbox resolves it (forkd_server/controller/checks.py), so
        # a kernel on a larger machine than its server's, or behind a fleet's router, asks for no more
        # than that host has
        value = os.environ.get("FORKD_KERNEL_MEMORY_LIMIT_MIB", "").strip()
        if not value or value == "host":
            return "host"
        try:
            return int(value)
        except ValueError:  # said under the first cell (_start)
            raise ValueError(f"$FORKD_KERNEL_MEMORY_LIMIT_MIB={value!r} is neither a whole number of MiB "
                             f"nor \"host\"") from None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._bad_url: BadServerURL | None = None
        try:
            self.controller = Controller()
        except BadServerURL as exc:  # a $FORKD_URL that names no server: said under the first cell (_start)
            self.controller, self._bad_url = Controller(DEFAULT_URL), exc
        self.base = BaseSnapshot(self.controller, engine=self.engine, setup=self.setup, packages=self.packages,
                                 tag=self.base_snapshot)
        self.head = Head(self.controller, self._on_other)
        self._idle_note: str | None = None  # a bad idle setting, said under the first cell
        try:
            freeze_after, store_after = self.freeze_after, self.store_after
        except ValueError as exc:
            freeze_after, store_after = 600.0, 3600.0
            self._idle_note = f"forkd: {exc}; the notebook's sandbox is frozen after 600 s and stored after 3600 s\n"
        self.idle = IdleTiers(self.controller, self.head, freeze_after, store_after,
                              log=lambda text: self.log.warning("%s", text))
        self.head.before_request = self.idle.awake  # a frozen or stored HEAD wakes before any request
        self.stack: list[str] = []     # where %forkd checkout - goes back to
        self.moved = False              # HEAD was checked out elsewhere at least once
        self.own: set[str] = set()      # sandboxes this kernel started (HEADs it moved through)
        self._recorded = False          # the server holds this kernel's record (set_kernel_head answered)
        self._parents: dict[str, dict] = {}  # request id -> the Jupyter message it serves
        self._last_parent: dict = {}
        self._local_parent: dict = {}
        self._notice: str | None = None
        self._start_error: Explained | None = None
        self._started = threading.Event()
        self.kernel_id = kernel_id() or f"pid-{os.getpid()}"
        self.notebook = notebook_path()
        self.labels = Scope.current().labels  # what the magics label, on every sandbox the notebook runs in
        self.local = LocalShell.make(self._publish_local)
        magics = KernelMagics(self.local, self)
        self.local.register_magics(magics)
        magics.completer = install_completer(self.local, magics)  # %forkd lines complete here
        self._install_comms()
        for kind in ("comm_open", "comm_msg", "comm_close"):
            self.shell_handlers[kind] = getattr(self, f"_{kind}")
        threading.Thread(target=self._start, name="forkd-kernel-start", daemon=True).start()

    # --- start: a fresh child of the base snapshot becomes HEAD ----------------------------------

    def _spawn(self, tag: str) -> str:
        """A sandbox of the notebook's: its labels, and its memory limit, a limit of its own, not the
        server's default, since memcg charges a page to whoever wrote it first, so the pages the
        notebook shares with every branch it keeps stay charged to it (docs/design/kernel.md)."""
        sandbox = spawn_when_written(self.controller, tag, 1, memory_limit_mib=self.memory_limit_mib,
                                     labels=self.labels)[0]["id"]
        self.own.add(sandbox)
        return sandbox

    def _start(self) -> None:
        try:
            if self._bad_url is not None:
                raise self._bad_url
            # the limit is read here, so a bad $FORKD_KERNEL_MEMORY_LIMIT_MIB is said under the first cell
            base = self.base.ensure(self.memory_limit_mib)
            self._notice = self.base.notice
            previous = None
            try:
                previous = self.controller.get_kernel(self.kernel_id).get("head")
            except ControllerError:
                pass
            sandbox = self._spawn(base)
            self.head.attach(sandbox, base)
            left = (self._register() or {}).get("left") or {}
            if previous and previous != sandbox and self.is_running(previous):
                self._notice = (self._notice or "") + (f"forkd: this kernel restarted in a fresh sandbox, {sandbox} (a child of {base}). "
                                f"The sandbox it ran in before, {previous}, still runs with its state: "
                                f"%forkd checkout {previous} to continue there, or %forkd kill {previous} to free it.\n")
            elif left.get("head") and left["head"] != sandbox and self.is_running(left["head"]):
                # the notebook's last kernel stopped with its Jupyter server: never silently fresh
                old = left["head"]
                self._notice = (self._notice or "") + (f"forkd: this notebook starts in a fresh sandbox, {sandbox} (a child of {base}): "
                                f"its last kernel stopped with the Jupyter server. The sandbox it ran in, {old}, still runs "
                                f"with its state: %forkd checkout {old} to continue there, or %forkd kill {old} to free it.\n")
        except (ControllerError, ServerUnreachable, RuntimeError, TimeoutError, OSError, ValueError, HeadGone) as exc:
            said = explained(exc, self.controller.base_url)
            if "memory_limit_mib" in str(exc):
                said.hint = "set $FORKD_KERNEL_MEMORY_LIMIT_MIB or ForkdKernel.memory_limit_mib within the server's bound"
            hint = said.hint or "fix the cause"
            if "restart the kernel" not in hint:
                hint += ", then restart the kernel"
            self._start_error = Explained(f"the forkd kernel could not start its sandbox: {said.what}", hint,
                                          {**said.details, "meanwhile": "the notebook's %forkd lines still run (in the kernel)"})
        finally:
            self._started.set()

    def is_running(self, sandbox_id: str) -> bool:
        try:
            self.controller.get_sandbox(sandbox_id)
            return True
        except (ControllerError, ServerUnreachable):
            return False

    def _register(self) -> dict | None:
        """Record HEAD with the server; its answer (``left``: where the notebook's last kernel ran, if
        its Jupyter server stopped it), or None if the server could not record it."""
        try:
            answer = self.controller.set_kernel_head(self.kernel_id, self.head.sandbox_id, notebook=self.notebook,
                                                     base_snapshot=self.base.tag, engine=self.base.resolved_engine)
            self._recorded = True
            return answer
        except (ControllerError, ServerUnreachable) as exc:  # the panel misses a marker; the notebook works
            self.log.warning("forkd: could not record HEAD with the server: %s", exc)
            return None

    def head_id(self) -> str | None:
        self._started.wait()
        return self.head.sandbox_id

    # --- HEAD moves ------------------------------------------------------------------------------

    def checkout(self, target: str) -> str | None:
        """Move HEAD to a sandbox, a fresh child of a snapshot, or (``-``) back where it was. The
        sandbox becomes the notebook's (``make_ours``); a HEAD that is gone is never gone back to."""
        self._started.wait()
        old = self.head.sandbox_id
        skipped: list[str] = []
        if target == "-":
            while self.stack and not self.is_running(self.stack[-1]):
                skipped.append(self.stack.pop())
            if not self.stack:
                gone = (f": {', '.join(skipped)} {'is' if len(skipped) == 1 else 'are'} gone" if skipped
                        else " (no checkout left to go back from)" if self.moved else " (no checkout yet)")
                raise UsageError(f"forkd checkout -: there is nowhere to go back to{gone}\n"
                                 f"%forkd checkout TAG|SB moves the notebook (%forkd ls lists what there is)")
            info, back = self.controller.get_sandbox(self.stack[-1]), True
        else:
            info, back = self._find(target), False
        new = info["id"]
        if new == old and self.head.ended is None:
            return f"HEAD is already {new}"
        notes = [] if new in self.own else make_ours(self.controller, info, self.labels, self.memory_limit_mib)
        notes += self._shared_with(new)
        self._close_sandbox_comms()
        try:
            self.head.attach(new, info.get("snapshot_tag"))
        except (ControllerError, ServerUnreachable) as exc:
            raise UsageError(f"forkd checkout: could not attach to {new}: {getattr(exc, 'message', exc)}") from None
        self.moved = True
        left = old is not None and old != new and self.is_running(old)
        if back:
            self.stack.pop()
        elif left:  # a HEAD that is gone is nowhere to go back to
            self.stack.append(old)
        self._register()
        said = f"HEAD: {old}{'' if left or old in (None, new) else ' (gone)'} → {new}"
        if back:
            said += f" (back; {', '.join(skipped)} gone)" if skipped else " (back)"
        way_back = self.way_back()
        print(said + (f"; %forkd checkout - returns to {way_back}" if way_back else ""))
        for note in notes:
            print(note, file=sys.stderr)
        return None

    def _shared_with(self, sandbox: str) -> list[str]:
        """A warning when ``sandbox`` is another kernel's HEAD too: both notebooks' cells would run in one
        namespace. Said, not refused: that kernel may have ended without a word (kill -9), its record
        left behind."""
        try:
            others = [k for k in self.controller.list_kernels()
                      if k.get("head") == sandbox and k.get("kernel_id") != self.kernel_id]
        except (ControllerError, ServerUnreachable):
            return []
        if not others:
            return []
        names = ", ".join(k.get("notebook") or f"kernel {k['kernel_id']}" for k in others)
        return [f"forkd: warning: {sandbox} is also the HEAD of {names}, whose cells run there too: the two notebooks "
                f"share its variables now (a cell in either changes them for both). For a copy of your own: "
                f"kids = %forkd fork {sandbox} -n 1, then %forkd checkout kids[0]."]

    def _find(self, target: str) -> dict:
        """The sandbox ``target`` names, or a fresh child of the snapshot it names."""
        try:
            return self.controller.get_sandbox(target)
        except ControllerError as exc:
            if exc.status != 404:
                raise
            missing = exc
        try:
            snapshot = self.controller.snapshot_info(target)
        except ControllerError:
            if target.startswith("sb-"):  # the server says when and why it ended, if it knows
                raise UsageError(f"forkd checkout: {missing.what}\n{missing.hint or '%forkd ls lists what there is'}") \
                    from None
            raise UsageError(f"forkd checkout: no sandbox or snapshot is called {target!r}\n%forkd ls lists them") \
                from None
        return self.controller.get_sandbox(self._spawn(snapshot["tag"]))  # a fresh child of it

    def way_back(self) -> str | None:
        """Where ``%forkd checkout -`` goes: the latest sandbox left that still runs."""
        return next((sb for sb in reversed(self.stack) if self.is_running(sb)), None)

    def _close_sandbox_comms(self) -> None:
        """Widgets of the sandbox being left would talk to a copy the notebook no longer runs in:
        close them on the frontend, so they look dead rather than silently drive the wrong copy."""
        for comm_id in list(self.head.comms):
            self._send_iopub("comm_close", {"comm_id": comm_id, "data": {}}, self._last_parent)
        self.head.comms.clear()

    # --- every request holds HEAD's moves down off until it is answered (idle.py) ----------------

    async def dispatch_shell(self, *args, **kwargs):
        self.idle.begin()
        try:
            return await super().dispatch_shell(*args, **kwargs)
        finally:
            self.idle.end()

    # --- execute ---------------------------------------------------------------------------------

    async def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False,
                         *, cell_meta=None, cell_id=None):
        parent = self.get_parent("shell")
        self._last_parent = parent
        for stream in (sys.stdout, sys.stderr):  # the kernel's own prints (from %forkd lines) go here
            if hasattr(stream, "set_parent"):
                stream.set_parent(parent)
        try:
            local = is_forkd_cell(code)
        except UsageError as exc:
            return self._error(parent, "UsageError", str(exc))
        if local:
            return self._run_local(code, silent, parent, user_expressions or {})
        if not self._started.is_set():  # the first sandbox is still being made: wait, loop responsive
            await asyncio.get_running_loop().run_in_executor(None, self._started.wait)
        if self._start_error:
            return self._error(parent, "ForkdKernelError", str(self._start_error), self._start_error.details)
        if self._notice or self._idle_note:
            self._send_iopub("stream", {"name": "stderr", "text": (self._notice or "") + (self._idle_note or "")}, parent)
            self._notice = self._idle_note = None
        try:
            woke = self.idle.awake()  # HEAD frozen or stored while the notebook idled: the cell says so
        except (ControllerError, ServerUnreachable) as exc:
            said = explained(exc, self.controller.base_url)
            return self._error(parent, "SandboxGone", f"forkd: could not wake this notebook's sandbox "
                                                      f"{self.head.sandbox_id}: {said.what}\n{said.hint or 'run the cell again'}",
                               said.details)
        if woke:
            self._send_iopub("stream", {"name": "stderr", "text": woke + "\n"}, parent)
        if self.head.ended is not None and self.head.reconnect():
            self._send_iopub("stream", {"name": "stderr", "text": (
                f"forkd: reconnected to {self.head.sandbox_id} (the server went away and came back; "
                f"the notebook's state is intact)\n")}, parent)
        try:
            return self._run_remote(code, silent, store_history, user_expressions or {}, allow_stdin, parent)
        except HeadGone as exc:
            return self._error(parent, "SandboxGone", str(exc), exc.details)

    def _run_remote(self, code, silent, store_history, user_expressions, allow_stdin, parent) -> dict:
        rid, events = self.head.open_request("execute", code=code, silent=silent, store_history=store_history,
                                             user_expressions=user_expressions, allow_stdin=allow_stdin,
                                             execution_count=self.execution_count)
        self._remember(rid, parent)
        try:
            with sigint_handled_by(lambda signum, frame: events.put(INTERRUPTED)):
                return self._follow(rid, events, parent)
        finally:
            self.head.finish(rid)

    def _follow(self, rid: str, events, parent: dict) -> dict:
        """Forward a remote cell's events until its reply; an Interrupt stops the cell in the sandbox."""
        while True:
            event = events.get()
            if event is INTERRUPTED:
                self.head.send({"type": "interrupt", "id": f"{rid}-interrupt"})
                continue
            if event is None:
                self.head.check()
                raise HeadGone(f"the session with {self.head.sandbox_id} ended during the cell")
            kind = event.get("type")
            if kind == "execute_reply":
                content = event.get("content") or {}
                content["execution_count"] = self.execution_count
                if content.get("status") == "error":
                    self._explain_name_error(content, parent)
                return content
            if kind == "input_request":
                self._answer_input(event, parent)
            elif kind not in REPLIES:
                self._publish(event, parent)

    def _answer_input(self, event: dict, parent: dict) -> None:
        try:
            # ipykernel's wait for the frontend's answer stops on KeyboardInterrupt
            with sigint_handled_by(signal.default_int_handler):
                value = self._input_request(event.get("prompt", ""),
                                            self._get_shell_context_var(self._shell_parent_ident),
                                            parent, password=bool(event.get("password")))
        except KeyboardInterrupt:
            self.head.send({"type": "interrupt", "id": "input-interrupt"})
            return
        except EOFError:
            value = "\x04"
        self.head.send({"type": "input_reply", "value": value})

    def _explain_name_error(self, content: dict, parent: dict) -> None:
        """A name bound by a %forkd line lives here, not in the sandbox: say so."""
        m = re.match(r"name '(\w+)' is not defined", content.get("evalue", ""))
        if content.get("ename") == "NameError" and m and m.group(1) in self.local.user_ns:
            name = m.group(1)
            try:  # %%forkd run is a way to use sandboxes only
                sandbox_ids([name], self.local.user_ns, "run")
                example = f" (e.g. %%forkd run {name})"
            except UsageError:
                example = ""
            value = as_python(self.local.user_ns[name])
            passed = f", or pass it into the sandbox as a value: {name} = {value}" if value else ""
            self._send_iopub("stream", {"name": "stderr", "text": (
                f"forkd: {name!r} was bound by a %forkd line, so it lives in the kernel, not in the notebook's "
                f"sandbox: use it in %forkd / %%forkd lines{example}{passed}\n")}, parent)

    def _run_local(self, code: str, silent: bool, parent: dict, user_expressions: dict) -> dict:
        """A %forkd cell, here; its reply as ipykernel's: the pager's payload (``%forkd?``) and the
        user expressions, evaluated in this namespace (the panel reads a line's result so)."""
        self._local_parent = parent
        self.local.execution_count = self.execution_count
        self.local.last_error = None
        result = self.local.run_cell(code, store_history=False, silent=silent)
        payload = self.local.payload_manager.read_payload()
        self.local.payload_manager.clear_payload()
        if result.success:
            return {"status": "ok", "execution_count": self.execution_count, "payload": payload,
                    "user_expressions": self.local.user_expressions(user_expressions)}
        error = self.local.last_error or {"ename": "Error", "evalue": str(result.error_in_exec), "traceback": []}
        return {"status": "error", "execution_count": self.execution_count, "payload": payload, **error}

    def _error(self, parent: dict, ename: str, evalue: str, details: dict | None = None) -> dict:
        """A cell's error as ipykernel shows one (its two lines: what, what to do), then its
        details, collapsed."""
        error = {"ename": ename, "evalue": evalue, "traceback": [f"\x1b[0;31m{ename}\x1b[0m: {evalue}"]}
        self._send_iopub("error", error, parent)
        if details:
            self._send_iopub("display_data", {"data": details_bundle(details), "metadata": {}, "transient": {}}, parent)
        return {"status": "error", "execution_count": self.execution_count, **error}

    # --- IOPub -----------------------------------------------------------------------------------

    def _remember(self, rid: str, parent: dict) -> None:
        self._parents[rid] = parent
        while len(self._parents) > 256:
            self._parents.pop(next(iter(self._parents)))

    def _publish(self, event: dict, parent: dict) -> None:
        kind = event["type"]
        if kind.startswith("comm_"):
            content = event.get("content") or {}
            buffers = [base64.b64decode(b) for b in event.get("buffers") or []]
            self._send_iopub(kind, content, parent, buffers=buffers, metadata=event.get("metadata") or {})
            return
        content = {k: v for k, v in event.items() if k not in ("type", "id")}
        self._send_iopub(kind, content, parent)

    def _send_iopub(self, kind: str, content: dict, parent: dict, **extra) -> None:
        self.session.send(self.iopub_socket, kind, content, parent=parent or None, ident=self._topic(kind), **extra)

    def _on_other(self, event: dict) -> None:
        """An event between requests (a widget's update, a background thread's print): show it
        under the request it answers, else under the latest cell."""
        if event.get("type") in REPLIES or event.get("type", "").endswith("_reply"):
            return
        self._publish(event, self._parents.get(event.get("id")) or self._last_parent)

    def _publish_local(self, kind: str, content: dict) -> None:
        self._send_iopub(kind, content, self._local_parent or self.get_parent("shell"))

    # --- the rest of the protocol: forwarded to HEAD ---------------------------------------------

    async def do_complete(self, code, cursor_pos):
        if on_forkd_line(code, cursor_pos) or not self._started.is_set() or self._start_error:
            return self.local.complete_reply(code, cursor_pos)
        try:
            reply = self.head.request("complete", code=code, cursor_pos=cursor_pos)
        except HeadGone:
            return self.local.complete_reply(code, cursor_pos)
        return with_forkd_magic(reply, code, cursor_pos)

    async def do_inspect(self, code, cursor_pos, detail_level=0, omit_sections=()):
        if on_forkd_line(code, cursor_pos):  # the magic lives here, not in the sandbox's shell
            return self.local.inspect_reply(code, cursor_pos, detail_level)
        try:
            return self.head.request("inspect", code=code, cursor_pos=cursor_pos, detail_level=detail_level,
                                     omit_sections=list(omit_sections))
        except HeadGone:
            return {"status": "ok", "found": False, "data": {}, "metadata": {}}

    async def do_is_complete(self, code):
        try:
            return self.head.request("is_complete", code=code)
        except HeadGone:
            status, indent = self.local.input_transformer_manager.check_complete(code)
            return {"status": status, **({"indent": " " * (indent or 0)} if status == "incomplete" else {})}

    async def do_history(self, hist_access_type, output, raw, session=None, start=None, stop=None, n=None,
                         pattern=None, unique=False):
        try:
            return self.head.request("history", hist_access_type=hist_access_type, start=start, stop=stop, n=n,
                                     pattern=pattern, unique=unique, output=output)
        except HeadGone:
            return {"status": "ok", "history": []}

    # --- comms: the kernel's own stay here, the sandbox's go there -------------------------------

    def _install_comms(self) -> None:
        import comm
        from ipykernel.comm import Comm, CommManager
        self.comm_manager = CommManager(parent=self, kernel=self)
        comm.create_comm = lambda *args, **kwargs: Comm(*args, kernel=self, **kwargs)
        comm.get_comm_manager = lambda: self.comm_manager

    def _is_local_comm(self, content: dict, opening: bool) -> bool:
        if opening:
            return content.get("target_name") in self.comm_manager.targets
        return content.get("comm_id") in self.comm_manager.comms

    def _forward_comm(self, kind: str, parent: dict) -> None:
        try:
            rid = self.head.check().new_id()
            self._remember(rid, parent)
            self.head.send({"type": kind, "id": rid, "content": parent.get("content") or {},
                            "metadata": parent.get("metadata") or {},
                            "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in parent.get("buffers") or []]})
        except HeadGone as exc:
            self.log.warning("forkd: %s for a widget of a sandbox this notebook no longer has: %s", kind, exc)

    async def _comm_open(self, stream, ident, parent):
        if self._is_local_comm(parent["content"], opening=True):
            self.comm_manager.comm_open(stream, ident, parent)
        else:
            self._forward_comm("comm_open", parent)

    async def _comm_msg(self, stream, ident, parent):
        if self._is_local_comm(parent["content"], opening=False):
            self.comm_manager.comm_msg(stream, ident, parent)
        else:
            self._forward_comm("comm_msg", parent)

    async def _comm_close(self, stream, ident, parent):
        if self._is_local_comm(parent["content"], opening=False):
            self.comm_manager.comm_close(stream, ident, parent)
        else:
            self._forward_comm("comm_close", parent)

    async def comm_info_request(self, stream, ident, parent):
        target = parent["content"].get("target_name")
        comms = {cid: {"target_name": c.target_name} for cid, c in self.comm_manager.comms.items()
                 if target is None or c.target_name == target}
        try:
            remote = self.head.request("comm_info", content={"target_name": target})
            comms.update(remote.get("comms") or {})
        except HeadGone:
            pass
        self.session.send(stream, "comm_info_reply", {"status": "ok", "comms": comms}, parent, ident)

    # --- shutdown --------------------------------------------------------------------------------

    async def do_shutdown(self, restart):
        """A restart keeps HEAD (the fresh kernel says where it is); a shutdown frees the sandboxes
        this kernel started. Snapshots (branches) and sandboxes made by %forkd fork stay."""
        self.idle.close()
        self.head.close()
        if not restart:
            try:
                self.controller.forget_kernel(self.kernel_id)
            except ControllerError as exc:
                if exc.status == 404 and self._recorded:
                    # its Jupyter server, stopping, marked it left (POST /v1/kernels/{id}/leave): the
                    # notebook's next kernel is told to continue in HEAD, so its sandboxes stay
                    return {"status": "ok", "restart": restart}
            except ServerUnreachable:
                pass
            for sandbox in self.own:
                try:
                    self.controller.kill_sandbox(sandbox)
                except (ControllerError, ServerUnreachable):
                    pass
        return {"status": "ok", "restart": restart}
