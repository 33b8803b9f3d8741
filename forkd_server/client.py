"""Client SDK for forkd's /v1 API: stdlib only, and importing it never imports jupyter_server.

``Controller`` keeps the PyPI ``forkd`` SDK's method names, arguments and wire bodies
(reference/forkd-api.md §8), so code written for forkd works unchanged; it adds ``create_snapshot``,
``run_code``, files, events and waiting for ``ready``. ``Sandbox`` and ``Snapshot`` give an E2B-like
surface on top::

    from forkd_server.client import Snapshot
    snap = Snapshot.create("py", setup="import numpy as np; data = np.ones(10**6)")
    with snap.fork()[0] as sb:
        sb.run_code("total = data.sum()")
        child_snap = sb.branch(mode="live", wait=False).wait()
        grandkids = child_snap.fork(3)

Where the server is: ``base_url`` argument, else ``$FORKD_URL``, else (inside a notebook, or on a
host with a running ``forkd serve`` / Jupyter server with forkd enabled) the running server found
from Jupyter's runtime files, else ``http://127.0.0.1:8889``. The token: ``token`` argument, else
``$FORKD_TOKEN``, else the discovered server's token.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field
from typing import Any

try:  # optional: parses a large listing several times faster; the standard library is enough
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _loads = json.loads

DEFAULT_URL = "http://127.0.0.1:8889"


class ForkWarning(UserWarning):
    """A branch asked for with ``lossy=True`` went ahead without what a fork() cannot carry (the
    process engine keeps one thread: other threads, child processes, pending asyncio tasks...).
    The snapshot keeps the list as ``warnings``; the VM engine carries all of it."""


def _warn_lossy(info: dict, source: str) -> None:
    if info.get("warnings"):
        lost = "".join(f"\n  - {w}" for w in info["warnings"])
        warnings.warn(ForkWarning(f"branch {info.get('tag')} of {source} did not carry:{lost}"), stacklevel=3)

__all__ = ["Controller", "ControllerError", "ServerUnreachable", "ServerTimeout", "ForkWarning", "Sandbox", "Snapshot", "CommandResult",
           "Execution", "EventStream", "discover_server"]


class ControllerError(Exception):
    """A non-2xx answer. ``body`` is the parsed JSON (``{"error": ...}``), else the text, else ``{}``."""

    def __init__(self, status: int, body: Any, url: str):
        self.status, self.body, self.url = status, body, url
        super().__init__(f"{status} from {url}: {self.message}")

    @property
    def message(self) -> str:
        if isinstance(self.body, dict) and "error" in self.body:
            return str(self.body["error"])
        return str(self.body) if self.body else "(empty body)"

    @property
    def lost(self) -> list[str]:
        """For a refused lossy fork (409): what it would have lost, one item each; else []."""
        return list(self.body.get("lost") or []) if isinstance(self.body, dict) else []


class ServerUnreachable(urllib.error.URLError):
    """No server answers at the URL (a ``URLError``, as forkd's SDK raises, with a helpful message)."""

    def __init__(self, url: str, reason: Any):
        super().__init__(reason)
        self.url = url

    def __str__(self) -> str:
        return (f"no forkd server answers at {self.url} ({self.reason}); start one with `forkd serve`, "
                f"or point FORKD_URL (and FORKD_TOKEN) at a running one")


class ServerTimeout(ServerUnreachable):
    """The server took the request but gave no answer in time (it is there, but busy or stuck)."""

    def __init__(self, url: str, reason: Any, timeout: float):
        super().__init__(url, reason)
        self.timeout = timeout

    def __str__(self) -> str:
        return (f"the forkd server at {self.url} gave no answer within {self.timeout:g} s; it is up, but what it "
                f"waits on (a sandbox that does not answer, a long setup) is taking longer: try again, or pass a "
                f"longer timeout")


# --- finding a running server -------------------------------------------------------------------

def _runtime_dir() -> str:
    if os.environ.get("JUPYTER_RUNTIME_DIR"):
        return os.environ["JUPYTER_RUNTIME_DIR"]
    try:  # jupyter_core knows every platform's default; it is light and does not pull in the server
        from jupyter_core.paths import jupyter_runtime_dir
        return jupyter_runtime_dir()
    except ImportError:
        base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
        return os.path.join(base, "jupyter", "runtime")


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def _probe(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=timeout) as r:  # noqa: S310 - loopback URL
            return json.loads(r.read() or b"{}").get("ok") is True
    except (OSError, ValueError):
        return False


def discover_server() -> tuple[str, str | None] | None:
    """Find a running server with forkd: ``(url, token)`` or None.

    Reads Jupyter's runtime files (``jpserver-<pid>.json``; ``forkd serve`` writes one too). The
    server that started this kernel (``JPY_PARENT_PID``) comes first. Each candidate must answer
    ``/healthz`` under its forkd prefix: ``<url>forkd`` inside jupyter lab, ``<url>`` for ``forkd serve``.
    """
    infos = []
    for path in glob.glob(os.path.join(_runtime_dir(), "jpserver-*.json")):
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        if info.get("url") and _pid_alive(info.get("pid")):
            info["_mtime"] = os.path.getmtime(path)
            infos.append(info)
    parent = os.environ.get("JPY_PARENT_PID")
    infos.sort(key=lambda i: (str(i.get("pid")) != parent, -i["_mtime"]))
    for info in infos[:8]:
        root = info["url"].rstrip("/")
        for url in (root + "/forkd", root):
            if _probe(url):
                return url, info.get("token") or None
    return None


# --- the Controller (forkd's SDK surface, plus ours) ---------------------------------------------

def _label_query(labels: dict[str, str] | None) -> dict | None:
    """``{"k": "v", ...}`` as the repeatable ``?label=k=v`` filter (every pair must match)."""
    return {"label": [f"{k}={v}" for k, v in labels.items()]} if labels else None


class Controller:
    """forkd's ``Controller``: the same method names, arguments and wire bodies, plus extras."""

    def __init__(self, base_url: str | None = None, token: str | None = None, timeout: float = 60.0):
        url = base_url or os.environ.get("FORKD_URL")
        found_token = None
        if not url:
            found = discover_server()
            url, found_token = found if found else (DEFAULT_URL, None)
        self.base_url = url.rstrip("/")
        self.token = token if token is not None else (os.environ.get("FORKD_TOKEN") or found_token)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Controller({self.base_url!r})"

    # -- transport --

    def _open(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
              content_type: str | None = None, timeout: float | None = None, query: dict | None = None):
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        headers = {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            data = raw
            headers["Content-Type"] = content_type or "application/octet-stream"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        timeout = timeout or self.timeout
        try:
            return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310
        except urllib.error.HTTPError as exc:
            text = exc.read()
            try:
                parsed = json.loads(text) if text else {}
            except ValueError:
                parsed = text.decode("utf-8", "replace")
            raise ControllerError(exc.code, parsed, url) from None
        except urllib.error.URLError as exc:  # no connection (urllib wraps what happens up to the request)
            raise ServerUnreachable(self.base_url, exc.reason) from None
        except TimeoutError as exc:  # connected and asked, but no answer in time
            raise ServerTimeout(self.base_url, exc, timeout) from None
        except ConnectionError as exc:
            raise ServerUnreachable(self.base_url, exc) from None

    def _request(self, method: str, path: str, body: Any = None, **kw) -> Any:
        with self._open(method, path, body, **kw) as resp:
            text = resp.read()
        return _loads(text) if text else None

    # -- forkd's methods (wire-identical) --

    def list_snapshots(self, *, labels: dict[str, str] | None = None) -> list[dict]:
        """Every snapshot; with ``labels``, those carrying all of them (``?label=k=v``)."""
        return self._request("GET", "/v1/snapshots", query=_label_query(labels))

    def delete_snapshot(self, tag: str, *, cascade: bool = False, force: bool = False) -> None:
        query = {k: "true" for k, v in (("cascade", cascade), ("force", force)) if v}
        return self._request("DELETE", f"/v1/snapshots/{tag}", query=query or None)

    def spawn_sandboxes(self, snapshot_tag: str, n: int = 1, per_child_netns: bool = False,
                        memory_limit_mib: int | None = None, prewarm: bool = False, live_fork: bool = False,
                        hugepages: bool = False, *, labels: dict[str, str] | None = None) -> list[dict]:
        """``labels``: added to the ones each child inherits from its snapshot."""
        body: dict = {"snapshot_tag": snapshot_tag, "n": n, "per_child_netns": per_child_netns}
        if memory_limit_mib is not None:
            body["memory_limit_mib"] = memory_limit_mib
        if labels:
            body["labels"] = dict(labels)
        for name, value in (("prewarm", prewarm), ("live_fork", live_fork), ("hugepages", hugepages)):
            if value:
                body[name] = True
        return self._request("POST", "/v1/sandboxes", body)

    def list_sandboxes(self, *, labels: dict[str, str] | None = None) -> list[dict]:
        """Every running sandbox; with ``labels``, those carrying all of them."""
        return self._request("GET", "/v1/sandboxes", query=_label_query(labels))

    def get_sandbox(self, sandbox_id: str) -> dict:
        return self._request("GET", f"/v1/sandboxes/{sandbox_id}")

    def kill_sandbox(self, sandbox_id: str) -> None:
        return self._request("DELETE", f"/v1/sandboxes/{sandbox_id}")

    def branch_sandbox(self, sandbox_id: str, tag: str | None = None, diff: bool = False,
                       measure_diff: bool = False, mode: str | None = None, wait: bool = True,
                       parent_tag: str | None = None, lossy: bool = False, *,
                       labels: dict[str, str] | None = None) -> dict:
        """Branch a running sandbox. A branch that would lose running work is refused (409 naming
        each item) unless ``lossy``; then the reply's ``warnings`` list it and a ForkWarning says so.
        The snapshot keeps the sandbox's labels, updated by ``labels``."""
        body: dict = {}
        if tag is not None:
            body["tag"] = tag
        if mode is not None:
            body["mode"] = mode
        elif diff:
            body["diff"] = True
        if measure_diff:
            body["measure_diff"] = True
        if not wait:
            body["wait"] = False
        if parent_tag is not None:
            body["parent_tag"] = parent_tag
        if lossy:
            body["lossy"] = True
        if labels:
            body["labels"] = dict(labels)
        info = self._request("POST", f"/v1/sandboxes/{sandbox_id}/branch", body)
        _warn_lossy(info, sandbox_id)
        return info

    def inventory(self, sandbox_id: str) -> dict:
        """What a branch of the sandbox now would not carry: ``{"id", "engine", "lost": [...]}``."""
        return self._request("GET", f"/v1/sandboxes/{sandbox_id}/inventory")

    def exec_command(self, sandbox_id: str, args: list[str], timeout_secs: float = 30, *,
                     env: dict | None = None, cwd: str | None = None) -> dict:
        body: dict = {"args": list(args), "timeout_secs": timeout_secs}
        if env:
            body["env"] = env
        if cwd:
            body["cwd"] = cwd
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/exec", body,
                             timeout=max(self.timeout, timeout_secs + 10))

    def eval_code(self, sandbox_id: str, code: str) -> dict:
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/eval", {"code": code})

    def ping_sandbox(self, sandbox_id: str) -> dict:
        # No body: urllib then sends Content-Length: 0 and no Content-Type, like forkd's SDK.
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/ping")

    # -- beyond forkd --

    def healthz(self) -> dict:
        return self._request("GET", "/healthz")

    def version(self) -> dict:
        return self._request("GET", "/version")

    def metrics(self) -> str:
        with self._open("GET", "/metrics") as resp:
            return resp.read().decode()

    def create_snapshot(self, tag: str, setup: str | None = None, setup_commands: list[list[str]] | None = None,
                        engine: str = "auto", mem_size_mib: int | None = None, host_network: bool = False,
                        disk_mib: int | None = None, packages: list[str] | None = None,
                        timeout: float = 900, shell: str | None = None, lossy: bool = False,
                        setup_timeout_secs: float | None = None, memory_limit_mib: int | None = None,
                        labels: dict[str, str] | None = None) -> dict:
        """``setup_timeout_secs`` bounds the whole creation (600 s unless given); the setup runs within
        a sandbox's limits, ``memory_limit_mib`` (the engine's default unless given) among them.
        ``labels``: string -> string pairs the snapshot carries, and its children and branches inherit."""
        body: dict = {"tag": tag, "engine": engine}
        if setup_timeout_secs is not None:
            body["setup_timeout_secs"] = setup_timeout_secs
            timeout = max(timeout, setup_timeout_secs + 60)
        if memory_limit_mib is not None:
            body["memory_limit_mib"] = memory_limit_mib
        if labels:
            body["labels"] = dict(labels)
        if shell is not None:
            body["shell"] = shell
        if lossy:
            body["lossy"] = True
        if disk_mib is not None:
            body["disk_mib"] = disk_mib
        if packages:
            body["packages"] = list(packages)
        if setup is not None:
            body["setup"] = setup
        if setup_commands:
            body["setup_commands"] = setup_commands
        if mem_size_mib is not None:
            body["mem_size_mib"] = mem_size_mib
        if host_network:
            body["host_network"] = True
        return self._request("POST", "/v1/snapshots", body, timeout=timeout)

    def snapshot_info(self, tag: str) -> dict:
        return self._request("GET", f"/v1/snapshots/{tag}/info")

    def compact_snapshot(self, tag: str, to: str, timeout: float = 900) -> dict:
        """An independent copy of snapshot ``tag`` under ``to`` (``branched_from: "compact:<tag>"``)."""
        return self._request("POST", f"/v1/snapshots/{tag}/compact", {"to": to}, timeout=timeout)

    # -- workspaces: named sandboxes that suspend into ws-<name>-state and resume from it --

    def list_workspaces(self) -> list[dict]:
        return self._request("GET", "/v1/workspaces")

    def create_workspace(self, name: str, snapshot_tag: str, memory_limit_mib: int | None = None) -> dict:
        body: dict = {"name": name, "snapshot_tag": snapshot_tag}
        if memory_limit_mib is not None:
            body["memory_limit_mib"] = memory_limit_mib
        return self._request("POST", "/v1/workspaces", body)

    def get_workspace(self, name: str) -> dict:
        return self._request("GET", f"/v1/workspaces/{name}")

    def suspend_workspace(self, name: str, diff: bool = False, timeout: float = 900) -> dict:
        return self._request("POST", f"/v1/workspaces/{name}/suspend", {"diff": bool(diff)}, timeout=timeout)

    def resume_workspace(self, name: str) -> dict:
        return self._request("POST", f"/v1/workspaces/{name}/resume")  # no body, like ping

    def delete_workspace(self, name: str) -> None:
        return self._request("DELETE", f"/v1/workspaces/{name}")

    def run_code(self, sandbox_id: str, code: str, timeout: float | None = None) -> dict:
        body: dict = {"code": code}
        if timeout is not None:
            body["timeout"] = timeout
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/run", body,
                             timeout=max(self.timeout, (timeout or 600) + 10))

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        reply = self._request("GET", f"/v1/sandboxes/{sandbox_id}/files", query={"path": path})
        if "entries" in reply:
            raise IsADirectoryError(f"{path} is a directory; use list_files")
        return base64.b64decode(reply["data_b64"])

    def write_file(self, sandbox_id: str, path: str, data: bytes | str, *, append: bool = False,
                   mode: int | None = None) -> dict:
        query = {"path": path}
        if append:
            query["append"] = "true"
        if mode is not None:
            query["mode"] = format(mode, "o")
        raw = data.encode() if isinstance(data, str) else bytes(data)
        return self._request("PUT", f"/v1/sandboxes/{sandbox_id}/files", raw=raw, query=query)

    def list_files(self, sandbox_id: str, path: str = ".") -> list[dict]:
        reply = self._request("GET", f"/v1/sandboxes/{sandbox_id}/files", query={"path": path})
        if "entries" not in reply:
            raise NotADirectoryError(f"{path} is a file; use read_file")
        return reply["entries"]

    def remove_file(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        query = {"path": path, **({"recursive": "true"} if recursive else {})}
        return self._request("DELETE", f"/v1/sandboxes/{sandbox_id}/files", query=query)

    def memory(self, sandbox_id: str) -> dict:
        return self._request("GET", f"/v1/sandboxes/{sandbox_id}/memory")

    # -- forkd kernels: which sandbox each notebook runs in --

    def list_kernels(self) -> list[dict]:
        return self._request("GET", "/v1/kernels")

    def get_kernel(self, kernel_id: str) -> dict:
        return self._request("GET", f"/v1/kernels/{kernel_id}")

    def set_kernel_head(self, kernel_id: str, head: str, *, notebook: str | None = None,
                        base_snapshot: str | None = None, engine: str | None = None) -> dict:
        body = {"head": head, **{k: v for k, v in (("notebook", notebook), ("base_snapshot", base_snapshot),
                                                    ("engine", engine)) if v is not None}}
        return self._request("PUT", f"/v1/kernels/{kernel_id}", body)

    def forget_kernel(self, kernel_id: str) -> None:
        return self._request("DELETE", f"/v1/kernels/{kernel_id}")

    def interrupt(self, sandbox_id: str) -> dict:
        """Interrupt the cell a sandbox is running (KeyboardInterrupt in it)."""
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/interrupt")

    def session(self, sandbox_id: str, shell: str = "plain", timeout: float = 120.0):
        """A streaming session with the sandbox (``forkd_server.streaming.Session``): cells whose
        output arrives as it is printed, input(), interrupts; ``shell="ipython"`` for IPython."""
        from .streaming import Session
        return Session(self, sandbox_id, shell=shell, timeout=timeout)

    def tree(self, *, labels: dict[str, str] | None = None) -> list[dict]:
        """The lineage as nodes; with ``labels``, the nodes carrying all of them and their ancestors."""
        return self._request("GET", "/v1/tree", query=_label_query(labels))

    def events(self, timeout: float | None = None) -> "EventStream":
        """Subscribe to change events (``{"kind", "action", "tag"|"id", "status", ...}``).

        The subscription is open when this returns, so no later change is missed; iterate the
        returned ``EventStream`` for events as they happen, ``close()`` it (from any thread) to stop.
        ``timeout`` bounds the wait for each next event (the server sends keep-alives every 15 s);
        ``socket.timeout`` / ``TimeoutError`` ends the iteration with an exception.
        """
        return EventStream(self._open("GET", "/v1/events", timeout=timeout or 3600))

    def wait_snapshot(self, tag: str, timeout: float = 120.0) -> dict:
        """Block until snapshot ``tag`` is ``ready`` or ``failed``; returns its SnapshotInfo.

        Listens on /v1/events, subscribed before each look at the snapshot, so no change is missed.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            stream = self._open("GET", "/v1/events", timeout=max(1.0, min(left, 20.0)))
            with stream:
                info = next((s for s in self.list_snapshots() if s["tag"] == tag), None)
                if info is None:
                    raise ControllerError(404, {"error": f"snapshot {tag} not found"}, self.base_url)
                if info.get("status", "ready") != "writing":
                    return info
                if left <= 0:
                    raise TimeoutError(f"snapshot {tag} still writing after {timeout:g} s")
                try:  # until an event names this tag; then look again
                    for line in stream:
                        if line.startswith(b"data:") and json.loads(line[5:]).get("tag") == tag:
                            break
                        if time.monotonic() > deadline:
                            break
                except (socket.timeout, TimeoutError):
                    pass  # a fresh stream and a fresh look

    def wait_ready(self, timeout: float = 30.0) -> dict:
        """Wait until the server answers /healthz (bounded polling); returns its answer."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._request("GET", "/healthz", timeout=2)
            except ServerUnreachable:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)


class EventStream:
    """An open ``/v1/events`` subscription: an iterator of event dicts; ``close()`` ends it."""

    def __init__(self, resp):
        self._resp = resp
        self._lines = iter(resp)
        self.closed = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> dict:
        data: list[str] = []
        try:
            for raw in self._lines:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line:
                    if data:
                        return json.loads("\n".join(data))
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())
        except Exception:
            if not self.closed:  # a read cut short by close() is the end of the stream, not an error
                raise
        self.close()
        raise StopIteration

    def close(self) -> None:
        """End the subscription; a thread blocked reading it sees the end of the stream."""
        if self.closed:
            return
        self.closed = True
        sock = getattr(getattr(getattr(self._resp, "fp", None), "raw", None), "_sock", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks a reader in another thread
        except OSError:
            pass
        self._resp.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- E2B-like objects ---------------------------------------------------------------------------

@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    error: str | None = None


@dataclass
class Execution:
    """The result of ``run_code``: like a notebook cell's outputs."""

    stdout: str = ""
    stderr: str = ""
    results: list[dict] = field(default_factory=list)   # display_data / execute_result mime bundles
    result: dict | None = None                           # the last expression's mime bundle
    error: dict | None = None                            # {"ename", "evalue", "traceback"}

    @property
    def text(self) -> str | None:
        return (self.result or {}).get("text/plain")


class _Commands:
    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def run(self, cmd: str | list[str], timeout: float = 30, *, env: dict | None = None,
            cwd: str | None = None) -> CommandResult:
        """Run a command (a str goes through ``/bin/sh -c``). A non-zero exit does not raise."""
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        r = self._sb.controller.exec_command(self._sb.id, args, timeout, env=env, cwd=cwd)
        return CommandResult(r.get("stdout", ""), r.get("stderr", ""), r.get("exit_code", 1), r.get("error"))


class _Files:
    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def read(self, path: str, format: str = "text") -> str | bytes:  # noqa: A002 - E2B's name
        data = self._sb.controller.read_file(self._sb.id, path)
        return data.decode() if format == "text" else data

    def write(self, path: str, data: str | bytes, *, append: bool = False) -> dict:
        return self._sb.controller.write_file(self._sb.id, path, data, append=append)

    def list(self, path: str = ".") -> list[dict]:
        return self._sb.controller.list_files(self._sb.id, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._sb.controller.remove_file(self._sb.id, path, recursive=recursive)

    def exists(self, path: str) -> bool:
        try:
            self._sb.controller._request("GET", f"/v1/sandboxes/{self._sb.id}/files", query={"path": path})
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True


class Sandbox:
    """A running sandbox. ``with Sandbox.create("py") as sb:`` kills it on exit."""

    def __init__(self, info: dict | str, controller: Controller | None = None):
        self.controller = controller or Controller()
        self.info = self.controller.get_sandbox(info) if isinstance(info, str) else dict(info)
        self.commands = _Commands(self)
        self.files = _Files(self)

    @classmethod
    def create(cls, snapshot_tag: str, *, controller: Controller | None = None, **spawn_options) -> "Sandbox":
        controller = controller or Controller()
        return cls(controller.spawn_sandboxes(snapshot_tag, 1, **spawn_options)[0], controller)

    @classmethod
    def connect(cls, sandbox_id: str, controller: Controller | None = None) -> "Sandbox":
        return cls(sandbox_id, controller)

    @classmethod
    def list(cls, controller: Controller | None = None, *, labels: dict[str, str] | None = None) -> list["Sandbox"]:
        controller = controller or Controller()
        return [cls(i, controller) for i in controller.list_sandboxes(labels=labels)]

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def snapshot_tag(self) -> str:
        return self.info["snapshot_tag"]

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.info.get("labels") or {})

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, snapshot_tag={self.snapshot_tag!r})"

    def ping(self) -> dict:
        return self.controller.ping_sandbox(self.id)

    def eval(self, code: str) -> str:
        """Evaluate one expression in the sandbox's persistent namespace; returns its repr."""
        reply = self.controller.eval_code(self.id, code)
        if reply.get("error"):
            raise RuntimeError(f"forkd eval: {reply['error']}")
        return reply.get("result")

    def run_code(self, code: str, timeout: float | None = None, *, on_event=None) -> Execution:
        """Run a cell through a streaming session: ``on_event(event)`` sees its output as it happens
        (``{"type": "stream", "name": "stdout", "text": ...}``, ``display_data``, ``error``...).
        After ``timeout`` seconds the cell is interrupted."""
        out: list[str] = []
        err: list[str] = []
        execution = Execution()

        def collect(event: dict) -> None:
            kind = event.get("type")
            if kind == "stream":
                (out if event.get("name") == "stdout" else err).append(event.get("text", ""))
            elif kind in ("display_data", "execute_result", "update_display_data"):
                execution.results.append({"type": kind, "data": event.get("data", {})})
                if kind == "execute_result":
                    execution.result = event.get("data")
            elif kind == "error":
                execution.error = {k: event.get(k) for k in ("ename", "evalue", "traceback")}
            if on_event is not None:
                on_event(event)

        with self.session() as session:
            reply = session.execute(code, on_event=collect, timeout=timeout, store_history=False)
        if reply.get("status") == "error" and execution.error is None:
            execution.error = {k: reply.get(k) for k in ("ename", "evalue", "traceback")}
        execution.stdout, execution.stderr = "".join(out), "".join(err)
        return execution

    def stream_code(self, code: str):
        """Run a cell and yield its events as they happen (``stream``, ``display_data``, ``error``...);
        the last is the ``execute_reply``. ``for event in sb.stream_code("...")``: print as it runs."""
        with self.session() as session:
            yield from session.stream(code, store_history=False)

    def session(self, shell: str = "plain"):
        """A streaming session with this sandbox (see ``Controller.session``)."""
        return self.controller.session(self.id, shell=shell)

    def interrupt(self) -> dict:
        return self.controller.interrupt(self.id)

    def branch(self, tag: str | None = None, *, mode: str | None = None, wait: bool = True,
               lossy: bool = False, labels: dict[str, str] | None = None) -> "Snapshot":
        """Turn this running sandbox into a new snapshot (it keeps running). ``lossy``: fork even if
        running work stays behind (a ForkWarning and ``Snapshot.warnings`` list it). ``labels``
        update the ones it inherits from this sandbox."""
        return Snapshot(self.controller.branch_sandbox(self.id, tag, mode=mode, wait=wait, lossy=lossy,
                                                       labels=labels), self.controller)

    def inventory(self) -> list[str]:
        """What a branch now would not carry (always [] on the VM engine)."""
        return self.controller.inventory(self.id)["lost"]

    def memory(self) -> dict:
        return self.controller.memory(self.id)

    def kill(self) -> None:
        try:
            self.controller.kill_sandbox(self.id)
        except ControllerError as exc:
            if exc.status != 404:
                raise

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class Snapshot:
    """A snapshot (a frozen, warmed-up interpreter); ``fork(n)`` makes sandboxes from it."""

    def __init__(self, info: dict | str, controller: Controller | None = None):
        self.controller = controller or Controller()
        if isinstance(info, str):
            info = next((s for s in self.controller.list_snapshots() if s["tag"] == info), None) or \
                self.controller.snapshot_info(info)
        self.info = dict(info)

    @classmethod
    def create(cls, tag: str, *, controller: Controller | None = None, **options) -> "Snapshot":
        controller = controller or Controller()
        return cls(controller.create_snapshot(tag, **options), controller)

    @property
    def tag(self) -> str:
        return self.info["tag"]

    @property
    def status(self) -> str:
        return self.info.get("status", "ready")

    @property
    def pause_ms(self) -> int | None:
        """How long the branch paused its source, in whole milliseconds rounded up (forkd's type)."""
        return self.info.get("pause_ms")

    @property
    def pause_us(self) -> int | None:
        """The same pause in microseconds: the precise figure."""
        return self.info.get("pause_us")

    @property
    def branched_from(self) -> str | None:
        return self.info.get("branched_from")

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.info.get("labels") or {})

    @property
    def warnings(self) -> list[str]:
        """What a lossy branch did not carry ([] for a complete copy)."""
        return list(self.info.get("warnings") or [])

    def __repr__(self) -> str:
        return f"Snapshot({self.tag!r}, status={self.status!r})"

    def wait(self, timeout: float = 120.0) -> "Snapshot":
        """Wait until the snapshot is ``ready`` (or ``failed``: raises)."""
        self.info = self.controller.wait_snapshot(self.tag, timeout)
        if self.status == "failed":
            raise RuntimeError(f"snapshot {self.tag} failed: {self.info.get('warning', '')}")
        return self

    def fork(self, n: int = 1, **spawn_options) -> list[Sandbox]:
        if self.status == "writing":
            self.wait()
        return [Sandbox(i, self.controller) for i in self.controller.spawn_sandboxes(self.tag, n, **spawn_options)]

    def details(self) -> dict:
        return self.controller.snapshot_info(self.tag)

    def delete(self, *, cascade: bool = False, force: bool = False) -> None:
        self.controller.delete_snapshot(self.tag, cascade=cascade, force=force)
