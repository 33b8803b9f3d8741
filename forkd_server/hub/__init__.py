"""forkd as a JupyterHub service: the Hub authenticates every request, users own what they make.

- ``identity.py``: ``HubIdentityProvider`` asks the Hub whose a token is (``HubAuth``); the server's
  own token stays an operator's.
- ``authorizer.py``: ``HubAuthorizer`` requires the service's access scope and keeps the routes that
  act for the whole server to admins.
- ``ownership.py``: the owner and shared labels and who may see and change what, on wire objects
  alone, so a router in front of many hosts can apply the same rule.
- ``events.py``: which events a user's ``/v1/events`` stream carries (``KeptLabels``, the labels
  events are judged by, serves the router's merged stream too).
- ``gate.py``: the Hub's check of one request for an app that is not a jupyter-server (the fleet's
  router, ``forkd router --hub``: ``fleet/hub.py``), with the two classes above.

``forkd serve --hub`` and ``forkd router --hub`` (or a Hub-managed service's environment) turn it
on; ``hub_settings`` reads that environment. Any jupyter-server app plugs it in the same way: the two classes as its
``identity_provider_class`` and ``authorizer_class``, and its handlers asking ``ownership.Caller``
about the wire objects they pass on (``handlers/base.py`` shows how). This package imports neither
jupyter_server nor jupyterhub at import time.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

IDENTITY = "forkd_server.hub.identity.HubIdentityProvider"
AUTHORIZER = "forkd_server.hub.authorizer.HubAuthorizer"


def managed_by_hub(environ=os.environ) -> bool:
    """Does this process run as a Hub service? JupyterHub gives its services a name and a token
    (a single-user server has a token but no service name)."""
    return bool(environ.get("JUPYTERHUB_SERVICE_NAME") and environ.get("JUPYTERHUB_API_TOKEN"))


def missing_environment(environ=os.environ) -> list[str]:
    """What ``forkd serve --hub`` cannot do without: the token to ask the Hub with, and the name whose
    access scope callers need (``JUPYTERHUB_API_URL`` has HubAuth's default, the Hub's own)."""
    return [name for name in ("JUPYTERHUB_API_TOKEN", "JUPYTERHUB_SERVICE_NAME") if not environ.get(name)]


def hub_settings(environ=os.environ) -> dict:
    """What the Hub's environment says about where to listen: ``host``, ``port`` (from
    ``JUPYTERHUB_SERVICE_URL``) and ``base_url`` (``JUPYTERHUB_SERVICE_PREFIX``, where the Hub's
    proxy sends the service's requests, unstripped), each only when set."""
    out = {}
    url = environ.get("JUPYTERHUB_SERVICE_URL")
    if url:
        parsed = urlparse(url)
        if parsed.hostname:
            out["host"] = parsed.hostname
        if parsed.port:
            out["port"] = parsed.port
    prefix = environ.get("JUPYTERHUB_SERVICE_PREFIX")
    if prefix:
        out["base_url"] = "/" + prefix.strip("/") + "/"
    return out
