"""Workspace routes: list and create, get and delete, suspend, resume."""

from __future__ import annotations

from jupyter_server.auth.decorator import authorized
from tornado import web

from .base import ForkdHandler
from .sandboxes import MEMORY_LIMIT

WORKSPACE_CREATE = {"name": ("string", True), "snapshot_tag": ("string", True),
                    "per_child_netns": ("boolean", False), "memory_limit_mib": ("mib", False, MEMORY_LIMIT),
                    "labels": ("labels", False)}
SUSPEND = {"diff": ("boolean", False)}


class WorkspacesHandler(ForkdHandler):
    auth_resource = "forkd:workspaces"
    body_spec = WORKSPACE_CREATE  # the JSON body of post

    @web.authenticated
    @authorized
    async def get(self) -> None:
        infos = await self.call(self.controller.list_workspaces)
        self.send(infos if self.viewer is None else [i for i in infos if self.viewer.sees(i["labels"])])

    @web.authenticated
    @authorized(action="execute")
    async def post(self) -> None:
        body = self.body(self.body_spec)
        if self.viewer is not None:
            await self.own("snapshot", body["snapshot_tag"])
        self.send(await self.long_call("a workspace", self.controller.create_workspace, body["name"],
                                       body["snapshot_tag"], memory_limit_mib=body.get("memory_limit_mib"),
                                       labels=self.stamped(body.get("labels"))), 201)


class WorkspaceHandler(ForkdHandler):
    auth_resource = "forkd:workspaces"
    owned = "workspace"

    @web.authenticated
    @authorized
    async def get(self, name: str) -> None:
        self.send(await self.call(self.controller.get_workspace, name))

    @web.authenticated
    @authorized
    async def delete(self, name: str) -> None:
        await self.call(self.controller.delete_workspace, name)
        self.no_content()


class WorkspaceSuspendHandler(ForkdHandler):
    auth_resource = "forkd:workspaces"
    owned = "workspace"
    body_spec = SUSPEND  # the JSON body of post

    @web.authenticated
    @authorized(action="execute")
    async def post(self, name: str) -> None:
        body = self.body(self.body_spec)
        self.send(await self.long_call("a suspend", self.controller.suspend_workspace, name,
                                       diff=body.get("diff", False)))


class WorkspaceResumeHandler(ForkdHandler):
    """No body, like ping: whatever is sent is ignored."""

    auth_resource = "forkd:workspaces"
    owned = "workspace"

    @web.authenticated
    @authorized(action="execute")
    async def post(self, name: str) -> None:
        self.send(await self.long_call("a resume", self.controller.resume_workspace, name))
