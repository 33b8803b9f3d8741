"""``POST /v1/fleet/register``: a host announces itself (``forkd serve --register``, registration.py).
It carries the registration token, not the router's client token."""

from __future__ import annotations

from ..router import Refusal
from .base import RouterHandler, check_token


class RegisterHandler(RouterHandler):
    public = True  # the registration token is checked here instead

    @property
    def registrations(self):
        """The router's ``Registrations`` (registration.py), or None when it takes none."""
        return self.settings.get("forkd_registrations")

    async def post(self) -> None:
        registrations = self.registrations
        if registrations is None:
            raise Refusal(403, "this router takes no registrations: start it with --register-token-file FILE (the "
                               "token hosts send with forkd serve --register; in a Jupyter server, "
                               "c.ForkdApp.router_register_token_file), or give it the hosts with --hosts")
        check_token(self, registrations.token)
        body = self.json_body()
        if body is None:
            raise Refusal(400, 'a registration is a JSON object {"url": "http(s)://HOST:PORT"} sent as '
                               'application/json')
        self.send(await registrations.announce(body))
