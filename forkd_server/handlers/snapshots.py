"""Snapshot routes: list and create, delete, info, compact, push and pull (a remote store)."""

from __future__ import annotations

import os

from jupyter_server.auth.decorator import authorized
from tornado import web

from ..controller.checks import check_tag
from ..errors import BadRequest
from ..hub.ownership import OWNER, SHARED
from .base import ApiError, ForkdHandler, query_bool, query_labels

SNAPSHOT_CREATE = {
    "tag": ("string", True), "engine": ("string", False), "setup": ("string", False),
    "setup_commands": ("string[][]", False), "mem_size_mib": ("integer", False),
    "host_network": ("boolean", False), "disk_mib": ("integer", False), "packages": ("string[]", False),
    "shell": ("string", False), "lossy": ("boolean", False), "labels": ("labels", False),
    "setup_timeout_secs": ("number", False), "memory_limit_mib": ("mib", False),
    # forkd's own form (kernel + rootfs) selects the VM engine
    "kernel": ("string", False), "rootfs": ("string", False), "rw": ("boolean", False),
    "tap": ("string", False), "boot_wait_secs": ("integer", False),
}
COMPACT = {"to": ("string", True), "labels": ("labels", False)}
PULL = {"tag": ("string", False), "digest": ("string", False)}
HOST_NETWORK_OFF = ("host_network is not allowed on this server: a sandbox on the host's network reaches every "
                    "service on the host's loopback, this server's own API included. To allow it, start the "
                    "server with `forkd serve --allow-host-network` (in jupyter lab: "
                    "--ForkdApp.allow_host_network=True, or c.ForkdApp.allow_host_network = True in its config)")


class SnapshotsHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"
    body_spec = SNAPSHOT_CREATE  # the JSON body of post

    @web.authenticated
    @authorized
    async def get(self) -> None:
        infos = await self.call(self.controller.list_snapshots, query_labels(self))
        self.send(infos if self.viewer is None else self.viewer.snapshots(infos))

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        body = self.body(self.body_spec)
        if body.get("host_network") and not self.app.allow_host_network:
            raise ApiError(403, HOST_NETWORK_OFF)
        engine = body.get("engine", "auto")
        if "kernel" in body or "rootfs" in body:  # forkd's form: a VM booted from kernel + rootfs
            try:
                check_tag(body["tag"])
            except BadRequest as exc:
                raise ApiError(400, exc.message) from None
            for what in ("kernel", "rootfs"):
                if not os.path.exists(body.get(what, "")):
                    raise ApiError(400, f"{what} not found: {body.get(what, '')}")
            engine = "vm"
        if body.get("boot_wait_secs", 10) > 60:  # both forms (forkd's checks it after the paths, as here)
            raise ApiError(400, "boot_wait_secs must be at most 60")
        info = await self.long_call(
            "a snapshot", self.controller.create_snapshot, body["tag"], engine=engine, setup=body.get("setup"),
            setup_commands=body.get("setup_commands"), mem_size_mib=body.get("mem_size_mib"),
            host_network=body.get("host_network", False), disk_mib=body.get("disk_mib"), packages=body.get("packages"),
            shell=body.get("shell", "plain"), lossy=body.get("lossy", False), labels=self.stamped(body.get("labels")),
            setup_timeout_secs=body.get("setup_timeout_secs"), memory_limit_mib=body.get("memory_limit_mib"))
        if "kernel" in body or "rootfs" in body:
            # Say so rather than pretend: the VM runs forkd's own guest (its agent speaks our protocol).
            info["warning"] = ("kernel and rootfs were checked, but the VM boots this server's guest image "
                               "(`forkd image build`); add software with packages, setup_commands or disk_mib")
        self.send(info, 201)


class SnapshotHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"
    owned, changes = "snapshot", ("DELETE",)

    @web.authenticated
    @authorized
    async def delete(self, tag: str) -> None:
        cascade, force = query_bool(self, "cascade"), query_bool(self, "force")
        await self.call(self.controller.delete_snapshot, tag, cascade=cascade, force=force)
        self.no_content()


class SnapshotInfoHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"
    owned = "snapshot"

    @web.authenticated
    @authorized
    async def get(self, tag: str) -> None:
        info = await self.call(self.controller.snapshot_detail, tag)
        if self.viewer is not None:  # what came of it is the caller's to see only where it is theirs
            mine = {s["id"] for s in await self.call(self.controller.list_sandboxes, {OWNER: self.viewer.name})}
            seen = {s["tag"] for s in self.viewer.snapshots(await self.call(self.controller.list_snapshots))}
            info["sandboxes"] = [i for i in info["sandboxes"] if i in mine]
            info["descendants"] = [t for t in info["descendants"] if t in seen]
        self.send(info)


class SnapshotCompactHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"
    owned = "snapshot"  # a copy of what the caller sees (a shared snapshot too) is the caller's
    body_spec = COMPACT  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, tag: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.long_call("a compaction", self.controller.compact_snapshot, tag, body["to"],
                                       labels=self.stamped(body.get("labels"))))  # 200


class SnapshotPushHandler(ForkdHandler):
    auth_resource = "forkd:snapshots"
    owned, changes = "snapshot", ("POST",)

    @web.authenticated
    @authorized(action="execute")
    async def post(self, tag: str) -> None:
        """Push to the server's remote store: {"digest", "store", "chunks", "uploaded_chunks", ...}."""
        self.send(await self.long_call("a push", self.controller.push_snapshot, tag))


class StoreSnapshotHandler(ForkdHandler):
    """``DELETE /v1/store/snapshots/{tag|sha256:digest}``: a snapshot leaves the remote store (its
    manifest and tags; chunks no other manifest lists, by mark and sweep)."""

    auth_resource = "forkd:snapshots"

    @web.authenticated
    @authorized
    async def delete(self, name: str) -> None:
        if self.viewer is not None:
            raise ApiError(403, "only JupyterHub admins may delete snapshots from the store here: the store is one "
                                "for all users, so a delete would take away anyone's pushed snapshot")
        self.send(await self.long_call("a delete from the store", self.controller.delete_remote_snapshot, name))


class SnapshotPullHandler(SnapshotHandler):
    """``POST /v1/snapshots/pull`` makes a snapshot from the remote store. The path is also that of a
    snapshot tagged ``pull``, which ``DELETE`` still deletes."""
    body_spec = PULL

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        if self.viewer is not None:
            raise ApiError(403, "only JupyterHub admins may pull snapshots from the store here: the store is one "
                                "for all users, so a pull would hand a user anyone's pushed snapshot")
        body = self.body(self.body_spec)
        self.send(await self.long_call("a pull", self.controller.pull_snapshot, tag=body.get("tag"),
                                       digest=body.get("digest")), 201)

    @web.authenticated
    @authorized
    async def delete(self) -> None:
        await self.own("snapshot", "pull", change=True)  # the path names no snapshot argument
        cascade, force = query_bool(self, "cascade"), query_bool(self, "force")
        await self.call(self.controller.delete_snapshot, "pull", cascade=cascade, force=force)
        self.no_content()


class SnapshotShareHandler(ForkdHandler):
    """``POST`` shares a snapshot with every user (``forkd.shared=true``: listed to all, spawnable by
    all, changed by admins only); ``DELETE`` takes the share back. Admins only under JupyterHub; with
    the server's own token, whoever holds it."""

    auth_resource = "forkd:snapshots"

    def _admin(self) -> None:
        caller = self.hub_caller
        if caller is not None and not caller.admin:
            raise ApiError(403, "only JupyterHub admins may share snapshots or take a share back")

    @web.authenticated
    @authorized(action="write")
    async def post(self, tag: str) -> None:
        self._admin()
        self.send(await self.call(self.controller.label_snapshot, tag, {SHARED: "true"}))

    @web.authenticated
    @authorized(action="write")
    async def delete(self, tag: str) -> None:
        self._admin()
        self.send(await self.call(self.controller.label_snapshot, tag, {}, remove=(SHARED,)))
