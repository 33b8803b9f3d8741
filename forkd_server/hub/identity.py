"""Who a request comes from when forkd runs as a JupyterHub service: the Hub says, from the token.

A request sends a Hub API token (a user's, or the one JupyterHub gives each single-user server as
``JUPYTERHUB_API_TOKEN``) as ``Authorization: token ...`` or ``Bearer ...``; ``HubAuth`` asks the Hub
whose it is (``GET /hub/api/user``, cached for ``HubAuth.cache_max_age`` seconds) and the answer
becomes a ``HubUser``: the name, whether the Hub counts them an admin, and the token's scopes, which
the authorizer (authorizer.py) checks. The server's own token (``--token-file``) still works, for
an operator: it acts as an admin. No cookie and no OAuth login: forkd has no pages, only an API.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jupyter_server.auth.identity import IdentityProvider, User
from tornado import web

from ..identity import same_secret

OPERATOR = "forkd-operator"  # the name of whoever holds the server's own token


@dataclass
class HubUser(User):
    """A user (or service) the Hub vouched for; ``operator``: the server's own token, no Hub user."""

    admin: bool = False
    scopes: frozenset = field(default_factory=frozenset)
    kind: str = "user"
    operator: bool = False


class HubIdentityProvider(IdentityProvider):
    """jupyter_server's identity provider, with the Hub answering for every token but the server's."""

    hub_auth = None  # a jupyterhub.services.auth.HubAuth, made on first use from the Hub's environment

    @property
    def auth_enabled(self) -> bool:
        return True

    def _auth(self):
        if self.hub_auth is None:
            from jupyterhub.services.auth import HubAuth
            self.hub_auth = HubAuth(parent=self)
        return self.hub_auth

    def get_token(self, handler) -> str | None:
        return self._auth().get_token(handler, in_cookie=False) or super().get_token(handler)

    async def get_user(self, handler) -> HubUser | None:
        if getattr(handler, "_jupyter_current_user", None):
            return handler._jupyter_current_user
        sent = self.get_token(handler)
        if not sent:
            return None
        handler._token_authenticated = True  # a token, never a cookie: no XSRF check applies
        if same_secret(sent, self.token):
            return HubUser(OPERATOR, admin=True, kind="operator", operator=True)
        try:
            model = await self._auth().user_for_token(sent, sync=False)
        except web.HTTPError as exc:
            # HubAuth answers 500 when it cannot reach the Hub: the request can be sent again, the
            # token may well be good.
            raise web.HTTPError(503, "%s", f"cannot check the token with JupyterHub at {self._auth().api_url}: "
                                           f"{exc.log_message or exc.reason}; try again when the Hub answers") from None
        if not model:
            handler._token_authenticated = False
            return None
        kind = model.get("kind", "user")
        name = model["name"] if kind == "user" else f"service:{model['name']}"
        return HubUser(name, admin=bool(model.get("admin")), scopes=frozenset(model.get("scopes") or ()), kind=kind)

    def process_login_form(self, handler):
        return None  # no login form: clients send a token

    def get_handlers(self) -> list:
        return []
