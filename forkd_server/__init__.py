"""forkd_server: the controller, the registry, the /v1 REST API, the client SDK and the CLI.

Kept light on purpose: importing ``forkd_server.client`` must not import jupyter_server.
"""

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict]:
    from .app import ForkdApp

    return [{"module": "forkd_server.app", "app": ForkdApp}]
