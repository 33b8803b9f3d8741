"""A notebook's last HEAD, kept by the router when a Jupyter server stops with its forkd kernels, so
the notebook's next kernel is told where its state runs on whichever host its new HEAD lands.

A host keeps the same for itself (kernels.py, ``kernels_left``) but tells only a kernel whose new
HEAD it records, and with two hosts holding the notebook's base snapshot the next kernel may land on
the other. So the router keeps it instead: it reads the kernel's record on its host, keeps the
notebook's HEAD in router.db (a ``kernel_left`` pin: by notebook, on the HEAD's host), then has the
host forget the record (``DELETE``: no row stays there to tell it a second time). The notebook's
next ``PUT /v1/kernels/{id}`` takes it, once, and adds it to the host's answer as ``left`` when
that sandbox still exists and is not the new HEAD.
"""

from __future__ import annotations

import time
from urllib.parse import quote

from .hosts import Host, HostError
from .router import Router

KIND = "kernel_left"


def key(notebook: str, caller=None) -> str:
    """Under JupyterHub two users' notebooks may share a path: each user's is their own."""
    return notebook if caller is None else f"{caller.name}\n{notebook}"


async def leave(router: Router, host: Host, kernel_id: str, caller=None,
                headers: dict | None = None) -> tuple[int, object]:
    """Mark ``kernel_id``'s record on ``host`` left: its notebook's HEAD kept here, the record gone
    there. The host's answer (204; 404 for a record it does not have); HostError if it is silent."""
    path, timeout = f"/v1/kernels/{quote(kernel_id, safe='')}", router.settings.host_timeout
    status, record = await host.request_json("GET", path, timeout=timeout, headers=headers)
    if status != 200 or not isinstance(record, dict):
        return status, record
    notebook = record.get("notebook")
    if isinstance(notebook, str) and notebook:  # kept before the host forgets: a crash between loses nothing
        router.state.pin(KIND, [(key(notebook, caller), {"head": record.get("head"), "kernel_id": kernel_id,
                                                          "left_at": time.time()})], host.url)
    return await host.request_json("DELETE", path, timeout=timeout, headers=headers)


async def tell(router: Router, notebook: str, caller, reply: dict) -> None:
    """Add to a host's answer to the notebook's ``PUT /v1/kernels/{id}`` the HEAD its last kernel
    left, taken (told once) whether or not it is said: said when it is not the new HEAD and its
    host still has it (a host that is gone or down cannot give the state back)."""
    taken = router.state.take(KIND, key(notebook, caller))
    if taken is None or reply.get("left"):  # nothing kept, or the host kept one itself (left on it directly)
        return
    url, left = taken
    host = router.hosts.get(url)
    if not left or left.get("head") in (None, reply.get("head")) or host is None or not host.up:
        return
    try:
        status, _ = await host.request_json("GET", f"/v1/sandboxes/{quote(left['head'], safe='')}",
                                            timeout=router.settings.host_timeout)
    except HostError:  # it cannot be said to still run
        return
    if status == 200:
        reply["left"] = {**left, "host": url}
