"""``forkd serve``'s identity provider: jupyter_server's token rules, compared in constant time.

jupyter_server's ``IdentityProvider`` compares the token a request carries with ``==``, whose time
depends on how many leading characters match; here both sides are compared with
``hmac.compare_digest``. ``forkd serve`` has no login page (clients send the token), so no
login or logout route is added either, and no cookie is read or set: the token is the only way in,
and every request it authenticates is the same user (an API has no browser session to remember).
Inside ``jupyter lab`` the user's own provider stays.
"""

from __future__ import annotations

import hmac

from jupyter_server.auth.identity import IdentityProvider, User


def same_secret(sent: str | None, expected: str | None) -> bool:
    """Constant-time comparison (for a given length) of a token sent with the expected one."""
    if not sent or not expected:
        return False
    return hmac.compare_digest(sent.encode(), expected.encode())


class ForkdIdentityProvider(IdentityProvider):
    # One user for every request the token (or, with --no-token, loopback) lets in. jupyter_server's
    # own rules would also read, sign and set a login cookie and make a user per browser: a fifth
    # of the CPU of a ping here, for a session no API client has.
    holder = User("forkd", name="forkd", display_name="forkd")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.token)  # `forkd serve --no-token`: loopback only, anyone on the host

    def get_user(self, handler) -> User | None:
        if not self.auth_enabled:
            return self.holder
        if not same_secret(self.get_token(handler), self.token):
            return None
        handler._token_authenticated = True  # a token, never a cookie: no XSRF check applies
        return self.holder

    def process_login_form(self, handler):
        return None  # no login form: clients send the token

    def get_handlers(self) -> list:
        return []
