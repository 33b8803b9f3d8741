"""Where the hosts are: a static list (``--hosts``), or every address a DNS name resolves to
(``--hosts-dns URL``: each address reached with the URL's scheme and port), resolved again on every
heartbeat, so hosts that join are followed (a Kubernetes headless Service lists the pods of the
hosts' DaemonSet this way). A host that leaves is not dropped: its heartbeat fails and it is
``down``, its sandboxes listed ``lost``, until an address answers there again."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from urllib.parse import urlsplit


class DiscoveryError(Exception):
    """A ``--hosts-dns`` the router cannot use; the message says why."""


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a host's URL (http(s)://HOST:PORT, forkd serve's address), or None."""
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:
        return "its port is not a number"
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return "use http(s)://HOST:PORT (forkd serve's address, its API at /v1)"
    if parts.username or parts.password or parts.query or parts.fragment:
        return "a host's URL has no user, query or fragment: use http(s)://HOST:PORT"
    return None


def host_list(items: list[str]) -> list[str]:
    """The hosts' URLs, however the command line gave them: one URL per item (``--ForkdApp.router_hosts
    URL`` again for each), comma-separated as ``forkd router --hosts`` takes them, or a JSON list
    (``--ForkdApp.router_hosts='["URL", "URL"]'``, which traitlets may hand over as one string)."""
    out = []
    for item in items:
        text = item.strip()
        if text.startswith("[") and text.endswith("]"):
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            if isinstance(parsed, list) and all(isinstance(u, str) for u in parsed):
                out += [u.strip() for u in parsed if u.strip()]
                continue
        out += [u.strip() for u in text.split(",") if u.strip()]
    return out


def parse_dns(url: str) -> tuple[str, str, int]:
    """(scheme, name, port) of ``--hosts-dns``, e.g. http://forkd-hosts.forkd.svc.cluster.local:8889."""
    parts = urlsplit((url or "").strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise DiscoveryError(f"--hosts-dns: {url!r} is not a URL of the hosts' name: use "
                             f"http(s)://NAME:PORT, e.g. http://forkd-hosts.forkd.svc.cluster.local:8889")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port


def host_url(scheme: str, address: str, port: int) -> str:
    shown = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{shown}:{port}"


async def resolve(scheme: str, name: str, port: int) -> list[str]:
    """Every host URL ``name`` resolves to now (sorted); empty if it does not resolve."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({host_url(scheme, info[4][0], port) for info in infos})
