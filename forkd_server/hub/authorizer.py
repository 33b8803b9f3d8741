"""What a Hub user may call: jupyter_server's ``Authorizer``, deciding by the Hub's scopes.

Every request needs a token holding the service's access scope, as JupyterHub defines it
(``access:services!service=<name>``, or ``access:services``; ``HubAuth.access_scopes``, from
``JUPYTERHUB_SERVICE_NAME``). Routes that act for the whole server are for admins only: metrics (its
counts are everyone's) and the MCP server (its tools act with the server's own token). Which objects
a user may touch is ownership.py's to say.
"""

from __future__ import annotations

from jupyter_server.auth.authorizer import Authorizer

from .identity import HubUser

ADMIN_ONLY = {
    "forkd:metrics": "/metrics counts every user's sandboxes",
    "forkd:mcp": "the MCP server's tools act with the server's own token",
}


class HubAuthorizer(Authorizer):
    def access_scopes(self) -> set[str]:
        return set(self.identity_provider._auth().access_scopes)

    def refusal(self, user, resource: str) -> str | None:
        """Why ``user`` may not call ``resource`` at all, or None when they may."""
        if not isinstance(user, HubUser):
            return "not a JupyterHub user"
        if user.operator:
            return None
        from jupyterhub.services.auth import check_scopes
        wanted = self.access_scopes()
        if not wanted or not check_scopes(wanted, set(user.scopes)):
            return (f"the token of {user.name} lacks the scope {' or '.join(sorted(wanted)) or 'access:services'}: "
                    f"in jupyterhub_config.py grant it to users (c.JupyterHub.extra_user_scopes) and to their "
                    f"servers' tokens (c.Spawner.server_token_scopes); docs/deploy/jupyterhub.md has the lines")
        if resource in ADMIN_ONLY and not user.admin:
            return f"only JupyterHub admins may use {resource.split(':')[1]} here: {ADMIN_ONLY[resource]}"
        return None

    def is_authorized(self, handler, user, action: str, resource: str) -> bool:
        why = self.refusal(user, resource)
        if why is not None:
            handler.forkd_refusal = why  # the 403's message (handlers/base.py)
        return why is None
