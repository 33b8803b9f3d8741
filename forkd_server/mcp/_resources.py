"""Resources: the lineage tree, and a sandbox's files (a file's bytes, a directory's listing)."""

from __future__ import annotations

import json

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError

from ..client import Controller, ControllerError, ServerUnreachable
from ._errors import describe

TREE_URI = "forkd://tree"
FILES_URI = "forkd://sandboxes/{sandbox_id}/files/{+path}"


def register(server: MCPServer, ctl: Controller) -> None:

    @server.resource(TREE_URI, name="lineage", mime_type="application/json")
    def lineage() -> str:
        """The lineage tree: every snapshot and running sandbox with its parent (JSON nodes)."""
        return json.dumps(_ask(TREE_URI, ctl.tree))

    @server.resource(FILES_URI, name="sandbox-file", mime_type="application/octet-stream")
    def sandbox_file(sandbox_id: str, path: str) -> str | bytes:
        """A file in a sandbox, by its absolute path without the leading slash
        (forkd://sandboxes/sb-1/files/tmp/out.csv is /tmp/out.csv): its text when it is UTF-8, else its
        bytes; a directory gives its listing as JSON."""
        uri = f"forkd://sandboxes/{sandbox_id}/files/{path}"
        try:
            data = _ask(uri, ctl.read_file, sandbox_id, "/" + path)
        except IsADirectoryError:
            return json.dumps(_ask(uri, ctl.list_files, sandbox_id, "/" + path))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data


def _ask(uri: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ControllerError as exc:
        if exc.status == 404:
            raise ResourceNotFoundError(f"{uri}: {describe(exc)}") from None
        raise ResourceError(f"{uri}: {describe(exc)}") from None
    except ServerUnreachable as exc:
        raise ResourceError(f"{uri}: {describe(exc)}") from None
