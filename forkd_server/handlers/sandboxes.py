"""Sandbox routes: spawn and list, get, change (labels, a higher memory limit) and kill, the agent
calls (ping, exec, eval, run, files, interrupt), branch, fork (a fork tree) and promote, inventory,
memory, and the moves between tiers (freeze, store, wake: tiers.py).

Control calls (list, get, change, kill, ping, interrupt, inventory, memory) use ``self.call``; long ones
``self.long_call``, and exec, eval and run in the sandbox's lane (admission.py)."""

from __future__ import annotations

import base64
import re
import time

from jupyter_server.auth.decorator import authorized
from tornado import web

from forkd_engine.agent.runtime import MAX_FILE_BYTES

from ..controller.checks import MAX_CHILDREN
from ..hub.ownership import OWNER
from .base import ApiError, ForkdHandler, caller_of, dumps, query_bool, query_labels

# What no machine has: more is refused on the wire (400), before it reaches a registry column.
MEMORY_LIMIT = {"maximum": 1 << 20}  # the controller checks the minimum (16), in forkd's order
SPAWN = {
    "snapshot_tag": ("string", True), "n": ("integer", False), "per_child_netns": ("boolean", False),
    "memory_limit_mib": ("mib", False, MEMORY_LIMIT), "prewarm": ("boolean", False),
    "live_fork": ("boolean", False), "hugepages": ("boolean", False), "labels": ("labels", False),
}
UPDATE = {"labels": ("labels", False), "remove_labels": ("string[]", False),
          "memory_limit_mib": ("mib", False, MEMORY_LIMIT)}
MAX_REASON = 300  # characters of a kill's ?reason=: one line of a 404
REASON_TEXT = re.compile("[^\x00-\x1f\x7f-\x9f\u2028\u2029]+\\Z")  # one line: no control character, no line break
MAX_TIMEOUT = 86400  # a day: past it a call is a job, not a request
TIMEOUT = {"exclusiveMinimum": 0, "maximum": MAX_TIMEOUT}
EXEC = {"args": ("string[]", True), "timeout_secs": ("number", False, TIMEOUT), "env": ("env", False),
        "cwd": ("string", False)}
EVAL = {"code": ("string", True)}
RUN = {"code": ("string", True), "timeout": ("number", False, TIMEOUT)}
BRANCH = {
    "tag": ("string", False), "mode": ("string", False), "diff": ("boolean", False), "live": ("boolean", False),
    "measure_diff": ("boolean", False), "wait": ("boolean", False), "parent_tag": ("string", False),
    "lossy": ("boolean", False), "labels": ("labels", False),
}


class SandboxesHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    body_spec = SPAWN  # the JSON body of post

    @web.authenticated
    @authorized
    async def get(self) -> None:
        labels = query_labels(self)
        if self.viewer is not None:  # a Hub user's own: a label filter like any other
            if labels.setdefault(OWNER, self.viewer.name) != self.viewer.name:
                self.send([])  # someone else's: none the caller may see
                return
        if labels:  # a filtered listing: small, not worth a cache
            self.send(await self.call(self.controller.list_sandboxes, labels))
            return
        gen, infos, live = await self.call(self.controller.sandbox_listing)
        # Each sandbox's JSON is encoded once per registry generation and reused until it changes.
        cached = self.app.listing_json
        if cached is None or cached[0] != gen:
            cached = self.app.listing_json = (gen, [dumps(info) for info in infos])
        self.set_status(200)
        self.finish(b"[" + b",".join(part for part, ok in zip(cached[1], live) if ok) + b"]")

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        body = self.body(self.body_spec)
        options = {k: body[k] for k in ("per_child_netns", "prewarm", "live_fork", "hugepages") if k in body}
        labels = self.stamped(body.get("labels"))
        if isinstance(body["snapshot_tag"], str) and self.viewer is not None:
            await self.own("snapshot", body["snapshot_tag"])
        t0 = time.perf_counter()
        out = await self.long_call("a spawn", self.controller.spawn, body["snapshot_tag"], body.get("n", 1),
                                   memory_limit_mib=body.get("memory_limit_mib"), labels=labels, **options)
        self.app.metrics.spawn_latency.observe(time.perf_counter() - t0)
        self.send(out, 201)


class SandboxHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    body_spec = UPDATE  # the JSON body of patch

    @web.authenticated
    @authorized
    async def get(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.get_sandbox, sandbox_id))

    @web.authenticated
    @authorized(action="write")
    async def patch(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        self.check_new_labels(body.get("labels"))
        self.check_new_labels(dict.fromkeys(body.get("remove_labels") or (), ""))  # nor the server's taken off
        self.send(await self.call(self.controller.update_sandbox, sandbox_id, labels=body.get("labels"),
                                  remove_labels=tuple(body.get("remove_labels") or ()),
                                  memory_limit_mib=body.get("memory_limit_mib")))

    @web.authenticated
    @authorized
    async def delete(self, sandbox_id: str) -> None:
        why = self._why()  # a bad one is refused before anything ends
        # Calls waiting for the sandbox end now; the one running ends when its agent goes.
        done = self.app.admission.ending(sandbox_id, f"DELETE /v1/sandboxes/{sandbox_id}")
        killed = False
        try:
            await self.call(self.controller.kill_sandbox, sandbox_id, why)
            killed = True
        finally:
            done(killed)
        self.no_content()

    def _why(self) -> str | None:
        """``?reason=``: why the kill, as the sandbox's 404 says it afterwards (a router's promote of
        a tree that spans hosts says what a host's promote says). Read raw: tornado drops control
        characters, which would record another line than the one sent."""
        raw = self.request.query_arguments.get("reason")
        if raw is None or raw[-1] == b"":  # ?reason= gives none, as an empty form field
            return None
        try:
            reason = raw[-1].decode()
        except UnicodeDecodeError:
            raise ApiError(400, "the reason query parameter must be UTF-8") from None
        if len(reason) > MAX_REASON or not REASON_TEXT.match(reason):
            raise ApiError(400, f"invalid query parameter reason={reason!r:.80}: one line of 1 to {MAX_REASON} "
                                f"characters, no control characters, e.g. ?reason=it%20lost%20the%20race")
        return reason


class PingHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    owned = "sandbox"

    @web.authenticated
    @authorized(action="read")
    async def post(self, sandbox_id: str) -> None:
        # on the event loop where nothing waits, else on the control pool (loop_calls.py); a plain
        # ping that failed on the loop (plain_ping.py) comes with its failure, explained, not made again
        failed = getattr(self.request, "ping_failed_on_loop", None)
        calls = self.app.loop_calls
        call = calls.explain(self.controller, failed) if failed else calls.ping(self.controller, sandbox_id)
        self.send(await self._answer(call, sandbox_id))

    def on_finish(self) -> None:
        if self.app.plain_pings is not None and self.get_status() == 200:
            self.app.plain_pings.learn(self.request, self._headers)  # forkd serve: plain_ping.py


class ExecHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    body_spec = EXEC  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self._answer(self.app.loop_calls.exec(
            self.controller, sandbox_id, body["args"], body.get("timeout_secs", 30), env=body.get("env"),
            cwd=body.get("cwd"), caller=caller_of(self)), sandbox_id))


class EvalHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    body_spec = EVAL  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self._answer(self.app.loop_calls.eval(self.controller, sandbox_id, body["code"],
                                                              caller=caller_of(self)), sandbox_id))


class RunHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    body_spec = RUN  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        kwargs = {"timeout": body["timeout"]} if "timeout" in body else {}
        self.send(await self.long_call("a run", self.controller.run_code, sandbox_id, body["code"],
                                       sandbox=sandbox_id, lane=True, **kwargs))


class BranchHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    body_spec = BRANCH  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        wait = body.get("wait", True)
        info = await self.long_call("a branch", self.controller.branch, sandbox_id, body.get("tag"),
                                    mode=body.get("mode"), diff=body.get("diff", False), live=body.get("live", False),
                                    measure_diff=body.get("measure_diff", False), wait=wait,
                                    parent_tag=body.get("parent_tag"), lossy=body.get("lossy", False),
                                    labels=self.stamped(body.get("labels")), sandbox=sandbox_id)
        if info.get("pause_us") is not None:  # the precise figure (pause_ms is rounded up)
            self.app.metrics.branch_pause.observe(info["pause_us"] / 1e6)
        self.send(info, 202 if not wait else 201)

FORK = {"count": ("integer", True, {"minimum": 1, "maximum": MAX_CHILDREN}), "tag": ("string", False), "labels": ("labels", False),
        "memory_limit_mib": ("mib", False, MEMORY_LIMIT), "lossy": ("boolean", False)}
PROMOTE = {"tree_id": ("string", False), "cleanup_siblings": ("boolean", False)}


class ForkHandler(ForkdHandler):
    """``POST {"count": N}``: branch the sandbox once, spawn N children of it (one fork tree)."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    body_spec = FORK  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.long_call("a fork", self.controller.fork, sandbox_id, body["count"], tag=body.get("tag"),
                                       labels=self.stamped(body.get("labels")), memory_limit_mib=body.get("memory_limit_mib"),
                                       lossy=body.get("lossy", False), sandbox=sandbox_id), 201)


class PromoteHandler(ForkdHandler):
    """``POST {"tree_id", "cleanup_siblings": true}``: the sandbox wins its fork tree."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    body_spec = PROMOTE  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.long_call("a promote", self.controller.promote, sandbox_id, body.get("tree_id"),
                                       body.get("cleanup_siblings", True), sandbox=sandbox_id))


class InterruptHandler(ForkdHandler):
    """No body: interrupt the cell the sandbox is running (a KeyboardInterrupt in it)."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"

    @web.authenticated
    @authorized(action="execute")
    async def post(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.interrupt, sandbox_id, sandbox=sandbox_id))


class InventoryHandler(ForkdHandler):
    """What a branch of the sandbox now would not carry (threads, child processes, ...)."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"

    @web.authenticated
    @authorized
    async def get(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.inventory, sandbox_id, sandbox=sandbox_id))


class MemoryHandler(ForkdHandler):
    auth_resource = "forkd:sandboxes"
    owned = "sandbox"

    @web.authenticated
    @authorized
    async def get(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.memory, sandbox_id, sandbox=sandbox_id))


class FreezeHandler(ForkdHandler):
    """No body: pause the sandbox (tier ``frozen``); the next call wakes it."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"

    @web.authenticated
    @authorized(action="write")
    async def post(self, sandbox_id: str) -> None:
        self.send(await self.call(self.controller.freeze_sandbox, sandbox_id, sandbox=sandbox_id))


class StoreHandler(ForkdHandler):
    """No body: write the sandbox's state to the store and end its process (tier ``stored``)."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"

    @web.authenticated
    @authorized(action="write")
    async def post(self, sandbox_id: str) -> None:
        self.send(await self.long_call("a store", self.controller.store_sandbox, sandbox_id, sandbox=sandbox_id))


class WakeHandler(ForkdHandler):
    """No body: make a frozen or stored sandbox running; its answer says how long that took."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"

    @web.authenticated
    @authorized(action="write")
    async def post(self, sandbox_id: str) -> None:
        self.send(await self.long_call("a wake", self.controller.wake_sandbox, sandbox_id, sandbox=sandbox_id))


class FilesHandler(ForkdHandler):
    """``GET`` reads a file (or lists a directory), ``PUT`` writes the raw body, ``DELETE`` removes."""

    auth_resource = "forkd:sandboxes"
    owned = "sandbox"
    max_body_bytes = MAX_FILE_BYTES  # what the agent writes at once

    def _path(self) -> str:
        # The raw value: tornado's get_query_argument drops control characters, which would
        # silently name another file; a NUL is refused instead (by the controller).
        raw = (self.request.query_arguments.get("path") or [b""])[-1]
        try:
            path = raw.decode()
        except UnicodeDecodeError:
            raise ApiError(400, "the path query parameter must be UTF-8") from None
        if not path:
            raise ApiError(400, "the path query parameter is required, e.g. ?path=/tmp/data.csv")
        return path

    @web.authenticated
    @authorized
    async def get(self, sandbox_id: str) -> None:
        path = self._path()
        try:
            self.send(await self.long_call("a file read", self.controller.files, sandbox_id, "read", path,
                                           sandbox=sandbox_id))
        except ApiError as exc:
            if exc.status_code != 400 or not exc.message.startswith("IsADirectoryError"):
                raise
            self.send(await self.long_call("a listing", self.controller.files, sandbox_id, "list", path,
                                           sandbox=sandbox_id))

    @web.authenticated
    @authorized(action="execute")
    async def put(self, sandbox_id: str) -> None:
        path = self._path()
        options = {"append": query_bool(self, "append")}
        mode = self.get_query_argument("mode", None)
        if mode is not None:
            try:
                options["mode"] = int(mode, 8)
            except ValueError:
                raise ApiError(400, f"invalid query parameter mode={mode!r}: use octal, e.g. 644") from None
        data = base64.b64encode(self.raw_body()).decode()
        self.send(await self.long_call("a file write", self.controller.files, sandbox_id, "write", path,
                                       data_b64=data, sandbox=sandbox_id, **options))

    @web.authenticated
    @authorized(action="execute")
    async def delete(self, sandbox_id: str) -> None:
        path = self._path()
        recursive = query_bool(self, "recursive")
        await self.long_call("a file removal", self.controller.files, sandbox_id, "remove", path,
                             recursive=recursive, sandbox=sandbox_id)
        self.no_content()
