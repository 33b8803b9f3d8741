"""``Controller`` and ``AsyncController``: the client of forkd's /v1 REST API, sync and async.

It keeps the PyPI ``forkd`` SDK's method names, arguments and wire bodies (reference/forkd-api.md
§8), so code written for forkd works unchanged, and adds ``create_snapshot``, ``run_code``, files,
workspaces, kernels, events and waiting for ``ready``. One method per route, written once in
``Calls``: each builds its request (``_core.Wire.request``) and hands it, or a generator of steps,
to ``_do``, which the sync transport runs to its result and the async one to an awaitable.
"""

from __future__ import annotations

import base64
import threading
import time

from ._async import AsyncTransport
from ._core import Close, NextEvent, Sleep, Subscribe, label_query
from ._errors import ControllerError, ServerUnreachable, warn_lossy
from ._sync import SyncTransport

__all__ = ["AsyncController", "Calls", "Controller"]


class Calls:
    """The controller's calls, written once (see the module's docstring). On ``AsyncController``
    each returns an awaitable of what the same call on ``Controller`` returns."""

    _SESSION = "Session"  # the streaming session class (forkd_server.streaming) of this family

    def _request(self, method: str, path: str, body=None, **kw):
        """One call to any route: its parsed JSON answer."""
        return self._do(self.request(method, path, body, **kw))

    # -- forkd's methods (wire-identical) --

    def list_snapshots(self, *, labels: dict[str, str] | None = None) -> list[dict]:
        """Every snapshot; with ``labels``, those carrying all of them (``?label=k=v``)."""
        return self._request("GET", "/v1/snapshots", query=label_query(labels))

    def delete_snapshot(self, tag: str, *, cascade: bool = False, force: bool = False) -> None:
        query = {k: "true" for k, v in (("cascade", cascade), ("force", force)) if v}
        return self._request("DELETE", f"/v1/snapshots/{tag}", query=query or None)

    def spawn_sandboxes(self, snapshot_tag: str, n: int = 1, per_child_netns: bool = False,
                        memory_limit_mib: int | str | None = None, prewarm: bool = False, live_fork: bool = False,
                        hugepages: bool = False, *, labels: dict[str, str] | None = None) -> list[dict]:
        """``labels``: added to the ones each child inherits from its snapshot. ``memory_limit_mib``:
        MiB, or ``"host"`` for all of the memory of the host the sandboxes land on."""
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
        return self._request("GET", "/v1/sandboxes", query=label_query(labels))

    def get_sandbox(self, sandbox_id: str) -> dict:
        return self._request("GET", f"/v1/sandboxes/{sandbox_id}")

    def kill_sandbox(self, sandbox_id: str, *, reason: str | None = None) -> None:
        """``reason``: why, one line of up to 300 characters, as the sandbox's 404 says it afterwards
        (default: killed by DELETE)."""
        return self._request("DELETE", f"/v1/sandboxes/{sandbox_id}", query={"reason": reason} if reason else None)

    def update_sandbox(self, sandbox_id: str, *, labels: dict[str, str] | None = None,
                       remove_labels: list[str] | None = None, memory_limit_mib: int | str | None = None) -> dict:
        """Add ``labels`` to a running sandbox's, take the keys ``remove_labels`` off, and raise its
        memory limit (never lowered: a 409; ``"host"``: to all of its host's memory, unless it has
        that already). Returns the sandbox's info as it is now."""
        body: dict = {}
        if labels:
            body["labels"] = dict(labels)
        if remove_labels:
            body["remove_labels"] = list(remove_labels)
        if memory_limit_mib is not None:
            body["memory_limit_mib"] = memory_limit_mib
        return self._request("PATCH", f"/v1/sandboxes/{sandbox_id}", body)

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
        return self._do(self.request("POST", f"/v1/sandboxes/{sandbox_id}/branch", body),
                        then=lambda info: warn_lossy(info, f"branch {info.get('tag')} of {sandbox_id} did not carry"))

    def fork_sandbox(self, sandbox_id: str, count: int = 1, *, tag: str | None = None,
                     labels: dict[str, str] | None = None, memory_limit_mib: int | str | None = None, lossy: bool = False,
                     timeout: float = 900) -> dict:
        """A fork tree: the sandbox branched once, ``count`` children spawned from that branch, each
        labelled ``fork_tree_id``. Returns ``{"fork_tree_id", "snapshot", "sandboxes"}``. ``tag``
        names the branch (a snapshot with a tag of yours is never released by a promote)."""
        body: dict = {"count": count}
        for name, value in (("tag", tag), ("memory_limit_mib", memory_limit_mib)):
            if value is not None:
                body[name] = value
        if labels:
            body["labels"] = dict(labels)
        if lossy:
            body["lossy"] = True

        def warned(tree: dict) -> dict:
            warn_lossy(tree["snapshot"], f"fork tree {tree['fork_tree_id']} of {sandbox_id} did not carry")
            return tree

        return self._do(self.request("POST", f"/v1/sandboxes/{sandbox_id}/fork", body, timeout=timeout), then=warned)

    def promote_sandbox(self, sandbox_id: str, tree_id: str | None = None, *, cleanup_siblings: bool = True,
                        timeout: float = 300) -> dict:
        """``sandbox_id`` wins its fork tree (``tree_id``: default, the one its label names): its
        siblings are killed (unless ``cleanup_siblings=False``) and the tree's snapshot is released
        if nothing needs it. Returns ``{"fork_tree_id", "winner", "killed", "released", "kept",
        "failed"}``; nothing another notebook, a workspace or a tag of yours holds is touched (``kept``
        says what stayed and why)."""
        body: dict = {"cleanup_siblings": bool(cleanup_siblings)}
        if tree_id is not None:
            body["tree_id"] = tree_id
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/promote", body, timeout=timeout)

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
        # No body: Content-Length: 0 and no Content-Type, like forkd's SDK; safe to send again
        return self._do(self.request("POST", f"/v1/sandboxes/{sandbox_id}/ping", idempotent=True))

    # -- beyond forkd --

    def healthz(self) -> dict:
        return self._request("GET", "/healthz")

    def version(self) -> dict:
        return self._request("GET", "/version")

    def metrics(self) -> str:
        return self._do(self.request("GET", "/metrics", text=True))

    def create_snapshot(self, tag: str, setup: str | None = None, setup_commands: list[list[str]] | None = None,
                        engine: str = "auto", mem_size_mib: int | None = None, host_network: bool = False,
                        disk_mib: int | None = None, packages: list[str] | None = None,
                        timeout: float = 900, shell: str | None = None, lossy: bool = False,
                        setup_timeout_secs: float | None = None, memory_limit_mib: int | str | None = None,
                        labels: dict[str, str] | None = None, *, kernel: str | None = None,
                        rootfs: str | None = None, boot_wait_secs: int | None = None) -> dict:
        """``setup_timeout_secs`` bounds the whole creation (600 s unless given); the setup runs within
        a sandbox's limits, ``memory_limit_mib`` (the engine's default unless given) among them.
        ``labels``: string -> string pairs the snapshot carries, and its children and branches inherit.
        ``lossy``: a setup that leaves running work its children lack is kept, and the reply's
        ``warnings`` list what (a ForkWarning says so). ``kernel``/``rootfs``/``boot_wait_secs``:
        forkd's form, which selects the VM engine."""
        given = {"setup": setup, "setup_commands": setup_commands or None, "mem_size_mib": mem_size_mib,
                 "host_network": host_network or None, "disk_mib": disk_mib,
                 "packages": list(packages) if packages else None, "shell": shell, "lossy": lossy or None,
                 "setup_timeout_secs": setup_timeout_secs, "memory_limit_mib": memory_limit_mib,
                 "labels": dict(labels) if labels else None,
                 "kernel": kernel, "rootfs": rootfs, "boot_wait_secs": boot_wait_secs}
        body = {"tag": tag, "engine": engine, **{k: v for k, v in given.items() if v is not None}}
        if setup_timeout_secs is not None:  # the call waits for the whole creation
            timeout = max(timeout, setup_timeout_secs + 60)
        return self._do(self.request("POST", "/v1/snapshots", body, timeout=timeout),
                        then=lambda info: warn_lossy(info, f"snapshot {tag}: its children lack what its setup "
                                                           f"left running"))

    def snapshot_info(self, tag: str) -> dict:
        return self._request("GET", f"/v1/snapshots/{tag}/info")

    def compact_snapshot(self, tag: str, to: str, timeout: float = 900, *, labels: dict[str, str] | None = None) -> dict:
        """An independent copy of snapshot ``tag`` under ``to`` (``branched_from: "compact:<tag>"``);
        ``labels``: added to the ones it takes from ``tag``."""
        body: dict = {"to": to}
        if labels:
            body["labels"] = labels
        return self._request("POST", f"/v1/snapshots/{tag}/compact", body, timeout=timeout)

    def share_snapshot(self, tag: str) -> dict:
        """Share snapshot ``tag`` with every user (label ``forkd.shared=true``): under JupyterHub all
        list it and spawn from it, only admins change it; admins only. Returns its SnapshotInfo."""
        return self._request("POST", f"/v1/snapshots/{tag}/share")

    def unshare_snapshot(self, tag: str) -> dict:
        """Take back ``share_snapshot``: the snapshot is its owner's alone again (admins only)."""
        return self._request("DELETE", f"/v1/snapshots/{tag}/share")

    # -- a remote store (forkd serve --store URL): snapshots that travel between hosts --

    def push_snapshot(self, tag: str, *, timeout: float = 3600) -> dict:
        """Push snapshot ``tag`` to the server's remote store; returns ``{"digest", "store",
        "chunks", "uploaded_chunks", "uploaded_bytes", "lookups"}``. Progress: events of action ``push``
        (``done_bytes``, ``total_bytes``); ``Controller`` takes ``progress=`` for them."""
        return self._request("POST", f"/v1/snapshots/{tag}/push", timeout=timeout)

    def pull_snapshot(self, tag: str | None = None, *, digest: str | None = None, timeout: float = 3600) -> dict:
        """Make a ready snapshot on the server from its remote store, by ``tag`` (the store's tag
        index) or ``digest`` (``sha256:...``); returns its SnapshotInfo (with ``pull`` figures)."""
        body = {"tag": tag} if tag is not None else {"digest": digest}
        return self._request("POST", "/v1/snapshots/pull", body, timeout=timeout)

    def delete_remote_snapshot(self, tag: str | None = None, *, digest: str | None = None,
                               timeout: float = 3600) -> dict:
        """Delete a snapshot from the server's remote store, by ``tag`` (the store's tag index) or
        ``digest``: its manifest and the tags naming it go, then every chunk no other manifest lists
        (mark and sweep; chunks written within the store's grace period stay). Returns ``{"digest",
        "store", "removed_chunks", "kept_chunks", "waiting_chunks"}`` (waiting: unlisted chunks the
        grace period keeps for now). Snapshots on the server itself stay."""
        return self._request("DELETE", f"/v1/store/snapshots/{tag if tag is not None else digest}", timeout=timeout)

    # -- tiers: running, frozen (paused, no CPU), stored (in the store, no process); a call wakes it --

    def freeze_sandbox(self, sandbox_id: str) -> dict:
        """Pause a sandbox, its memory kept and no CPU used (tier ``frozen``); its SandboxInfo."""
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/freeze")

    def store_sandbox(self, sandbox_id: str, *, timeout: float = 900) -> dict:
        """Write a VM sandbox's state to the store and end its process (tier ``stored``); a 409 on
        the process engine, whose deepest tier is frozen."""
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/store", timeout=timeout)

    def wake_sandbox(self, sandbox_id: str, *, timeout: float = 900) -> dict:
        """Make a frozen or stored sandbox running; its SandboxInfo plus ``wake`` (``ms``, and from
        stored ``fetch_ms``, ``decompress_ms``, ``restore_ms``). Any other call wakes it too."""
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/wake", timeout=timeout)

    # -- workspaces: named sandboxes that suspend into ws-<name>-state and resume from it --

    def list_workspaces(self) -> list[dict]:
        return self._request("GET", "/v1/workspaces")

    def create_workspace(self, name: str, snapshot_tag: str, memory_limit_mib: int | str | None = None, *,
                         labels: dict[str, str] | None = None) -> dict:
        """``labels``: the workspace's, given to its sandboxes and its state snapshots."""
        body: dict = {"name": name, "snapshot_tag": snapshot_tag}
        if memory_limit_mib is not None:
            body["memory_limit_mib"] = memory_limit_mib
        if labels:
            body["labels"] = labels
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
        def data(reply: dict) -> bytes:
            if "entries" in reply:
                raise IsADirectoryError(f"{path} is a directory; use list_files")
            return base64.b64decode(reply["data_b64"])

        return self._do(self.request("GET", f"/v1/sandboxes/{sandbox_id}/files", query={"path": path}), then=data)

    def write_file(self, sandbox_id: str, path: str, data: bytes | str, *, append: bool = False,
                   mode: int | None = None) -> dict:
        query = {"path": path}
        if append:
            query["append"] = "true"
        if mode is not None:
            query["mode"] = format(mode, "o")
        raw = data.encode() if isinstance(data, str) else bytes(data)
        return self._request("PUT", f"/v1/sandboxes/{sandbox_id}/files", raw=raw, query=query,
                             idempotent=not append)

    def list_files(self, sandbox_id: str, path: str = ".") -> list[dict]:
        def entries(reply: dict) -> list[dict]:
            if "entries" not in reply:
                raise NotADirectoryError(f"{path} is a file; use read_file")
            return reply["entries"]

        return self._do(self.request("GET", f"/v1/sandboxes/{sandbox_id}/files", query={"path": path}), then=entries)

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

    def checkout_kernel(self, kernel_id: str, sandbox_id: str, timeout: float = 120.0) -> dict:
        """Move a forkd-kernel notebook to ``sandbox_id``: ``%forkd checkout`` run in its kernel
        (after any cell it is running), as the panel's Check out does."""
        return self._request("POST", f"/v1/kernels/{kernel_id}/checkout", {"sandbox": sandbox_id}, timeout=timeout)

    def forget_kernel(self, kernel_id: str) -> None:
        return self._request("DELETE", f"/v1/kernels/{kernel_id}")

    def leave_kernel(self, kernel_id: str) -> None:
        """The kernel stops with its Jupyter server: its record goes, its notebook's HEAD is kept for
        the notebook's next kernel (told in its ``set_kernel_head`` answer, ``left``)."""
        return self._request("POST", f"/v1/kernels/{kernel_id}/leave")

    def interrupt(self, sandbox_id: str) -> dict:
        """Interrupt the cell a sandbox is running (KeyboardInterrupt in it)."""
        return self._request("POST", f"/v1/sandboxes/{sandbox_id}/interrupt")

    def session(self, sandbox_id: str, shell: str = "plain", timeout: float = 120.0):
        """A streaming session with the sandbox (``forkd_server.streaming.Session``; for
        ``AsyncController`` an ``AsyncSession``: ``async with ctl.session(id) as s``): cells whose
        output arrives as it is printed, input(), interrupts; ``shell="ipython"`` for IPython."""
        from .. import streaming
        return getattr(streaming, self._SESSION)(self, sandbox_id, shell=shell, timeout=timeout)

    def tree(self, *, labels: dict[str, str] | None = None) -> list[dict]:
        """The lineage as nodes; with ``labels``, the nodes carrying all of them and their ancestors."""
        return self._request("GET", "/v1/tree", query=label_query(labels))

    def events(self, timeout: float | None = None):
        """Subscribe to change events (``{"kind", "action", "tag"|"id", "status", ...}``).

        The subscription is open when this returns, so no later change is missed; iterate the
        returned ``EventStream`` for events as they happen, ``close()`` it (from any thread) to stop
        (``AsyncController``: ``stream = await ctl.events()``, ``async for``, ``await stream.aclose()``).
        ``timeout`` bounds the wait for each next event (the server sends keep-alives every 15 s);
        ``socket.timeout`` / ``TimeoutError`` ends the iteration with an exception.
        """
        return self._do(self._subscribe_steps(timeout or 3600))

    def _subscribe_steps(self, timeout: float):
        return (yield Subscribe(self.request("GET", "/v1/events", timeout=timeout)))

    def wait_snapshot(self, tag: str, timeout: float = 120.0) -> dict:
        """Block until snapshot ``tag`` is ``ready`` or ``failed``; returns its SnapshotInfo.

        Listens on /v1/events, subscribed before each look at the snapshot, so no change is missed.
        """
        return self._do(self._wait_snapshot(tag, timeout))

    def _wait_snapshot(self, tag: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            stream = yield from self._subscribe_steps(max(1.0, min(left, 20.0)))
            try:
                snapshots = yield from self.plan.list_snapshots()
                info = next((s for s in snapshots if s["tag"] == tag), None)
                if info is None:
                    raise ControllerError(404, {"error": f"snapshot {tag} not found"}, self.base_url)
                if info.get("status", "ready") != "writing":
                    return info
                if left <= 0:
                    raise TimeoutError(f"snapshot {tag} still writing after {timeout:g} s")
                try:  # until an event names this tag; then look again
                    while (event := (yield NextEvent(stream))) is not None:
                        if event.get("tag") == tag or time.monotonic() > deadline:
                            break
                except TimeoutError:
                    pass  # a fresh stream and a fresh look
            finally:
                yield Close(stream)

    def wait_ready(self, timeout: float = 30.0) -> dict:
        """Wait until the server answers /healthz (bounded polling); returns its answer."""
        return self._do(self._wait_ready(timeout))

    def _wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return (yield self.request("GET", "/healthz", timeout=2))
            except ServerUnreachable:
                if time.monotonic() > deadline:
                    raise
            yield Sleep(0.05)


class Controller(Calls, SyncTransport):
    """forkd's ``Controller``: the same method names, arguments and wire bodies, plus extras.

    Its connections to the server are kept alive and pooled (``max_connections``, shared by the
    threads that use it); ``close()`` or ``with Controller() as ctl:`` closes them."""

    def push_snapshot(self, tag: str, *, progress=None, timeout: float = 3600) -> dict:
        """``progress(done_bytes, total_bytes)`` is called from another thread as the push goes."""
        return self._with_progress("push", tag, progress, lambda: super(Controller, self).push_snapshot(
            tag, timeout=timeout))

    def pull_snapshot(self, tag: str | None = None, *, digest: str | None = None, progress=None,
                      timeout: float = 3600) -> dict:
        """``progress(done_bytes, total_bytes)`` is called from another thread as the pull goes."""
        return self._with_progress("pull", tag, progress, lambda: super(Controller, self).pull_snapshot(
            tag, digest=digest, timeout=timeout))

    def _with_progress(self, action: str, tag: str | None, progress, call):
        if progress is None:
            return call()
        stream = self.events()  # subscribed before the call: no progress event is missed

        def follow():
            try:
                for event in stream:
                    if event.get("action") == action and (tag is None or event.get("tag") == tag) \
                            and "total_bytes" in event:
                        progress(event["done_bytes"], event["total_bytes"])
            except Exception:  # noqa: BLE001 - progress is a courtesy: the call's own answer is what counts
                pass

        reader = threading.Thread(target=follow, name=f"forkd-{action}-progress", daemon=True)
        reader.start()
        try:
            return call()
        finally:
            stream.close()
            reader.join(5)


class AsyncController(Calls, AsyncTransport):
    """``Controller`` for asyncio: the same methods, arguments, answers and errors, each awaited
    (``await ctl.ping_sandbox(id)``). One pool of kept-alive connections (``_http1``) serves all the
    calls a task or many tasks make at once; ``async with AsyncController() as ctl:`` closes it."""

    _SESSION = "AsyncSession"
