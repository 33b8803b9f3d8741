"""The Hub's check of one request, for an app that is not a jupyter-server (the fleet's router).

A jupyter-server app (``forkd serve --hub``) plugs ``HubIdentityProvider`` and ``HubAuthorizer`` in as
its identity provider and authorizer; a plain tornado app asks a ``HubGate`` in its handlers'
``prepare`` instead, and gets the same answers: whose the token is, per the Hub; a 401 when there is
none or the Hub does not know it; a 403 naming the scope a token lacks, or the admin-only route.
"""

from __future__ import annotations

from .authorizer import HubAuthorizer
from .identity import HubIdentityProvider, HubUser
from .ownership import Refused


class HubGate:
    """``token``: the app's own secret, an operator's (acts as an admin), or None for none."""

    def __init__(self, token: str | None):
        # "" rather than None: IdentityProvider would otherwise make up a token of its own
        self.identity = HubIdentityProvider(token=token or "")
        self.authorizer = HubAuthorizer(identity_provider=self.identity)

    @property
    def hub_auth(self):
        """jupyterhub's ``HubAuth``, as configured by the Hub's environment."""
        return self.identity._auth()

    def access_scopes(self) -> set[str]:
        return self.authorizer.access_scopes()

    async def user(self, handler, resource: str) -> HubUser:
        """Who sent ``handler``'s request, if they may call ``resource``; else Refused (401, 403; a
        Hub that does not answer: tornado's 503 from the identity provider)."""
        user = await self.identity.get_user(handler)
        if user is None:
            raise Refused(401, "invalid bearer token" if self.identity.get_token(handler) else "missing bearer token")
        why = self.authorizer.refusal(user, resource)
        if why is not None:
            raise Refused(403, why)
        return user
