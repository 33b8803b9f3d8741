"""Tiers for agents: ``freeze_sandbox`` (paused, no CPU), ``store_sandbox`` (its state in the store,
no process, no RAM; VM engine) and ``wake_sandbox``, one REST route each through the SDK. Any other
tool that needs a sandbox wakes it by itself; ``wake_sandbox`` does it ahead of time and says how
long it took."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

from ..client import Controller
from ._errors import explained

# A move between tiers keeps the sandbox's state (nothing is destroyed) and moving it again to the
# tier it is in changes nothing.
MOVES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)


def register(server: MCPServer, ctl: Controller) -> None:

    @server.tool(annotations=MOVES)
    @explained("freeze_sandbox")
    def freeze_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Pause an idle sandbox: its memory is kept, it uses no CPU (``tier: frozen``). The next
        call to it (or wake_sandbox) thaws it in milliseconds, its state intact. Refused while a
        call runs in it."""
        return ctl.freeze_sandbox(sandbox_id)

    @server.tool(annotations=MOVES)
    @explained("store_sandbox")
    def store_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Write an idle VM sandbox's whole state into the server's store (and its remote store, when
        it has one) and end its process: ``tier: stored``, no process, no RAM, the same id. The next
        call to it (or wake_sandbox) restores it, state intact, in about a second or two. A sandbox
        on the process engine cannot be stored (freeze_sandbox is its deepest tier)."""
        return ctl.store_sandbox(sandbox_id)

    @server.tool(annotations=MOVES)
    @explained("wake_sandbox")
    def wake_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Make a frozen or stored sandbox running again now, rather than on its next call. Returns
        its info and ``wake``: where it woke from and how long it took (``ms``; from stored also
        ``fetch_ms``, ``decompress_ms``, ``restore_ms``)."""
        return ctl.wake_sandbox(sandbox_id)
