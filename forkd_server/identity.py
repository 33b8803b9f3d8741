"""``forkd serve``'s identity provider: jupyter_server's token rules, compared in constant time.

jupyter_server's ``IdentityProvider`` compares the token a request carries with ``==``, whose time
depends on how many leading characters match; here both sides are compared with
``hmac.compare_digest``. ``forkd serve`` has no login page (clients send the token), so no
login or logout route is added either. Inside ``jupyter lab`` the user's own provider stays.
"""

from __future__ import annotations

import hmac

from jupyter_server.auth.identity import IdentityProvider


def same_secret(sent: str | None, expected: str | None) -> bool:
    """Constant-time comparison (for a given length) of a token sent with the expected one."""
    if not sent or not expected:
        return False
    return hmac.compare_digest(sent.encode(), expected.encode())


class ForkdIdentityProvider(IdentityProvider):
    @property
    def auth_enabled(self) -> bool:
        return bool(self.token)  # `forkd serve --no-token`: loopback only, anyone on the host

    async def get_user_token(self, handler):
        if not same_secret(self.get_token(handler), handler.token):
            return None
        user = self.get_user_cookie(handler)
        if hasattr(user, "__await__"):
            user = await user
        return user if user is not None else self.generate_anonymous_user(handler)

    def process_login_form(self, handler):
        return None  # no login form: clients send the token

    def get_handlers(self) -> list:
        return []
