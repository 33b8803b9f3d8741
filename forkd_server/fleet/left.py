"""A notebook's last HEAD, kept by the router when a Jupyter server stops with its forkd kernels, so
the notebook's next kernel is told where its state runs on whichever host its new HEAD lands.

A host keeps it for itself (kernels.py, ``kernels_left``) but tells only a kernel whose new HEAD it
records, and with two hosts holding the notebook's base snapshot the next kernel may land on the
other. So the router passes the leave on and keeps a copy in router.db (a ``kernel_left`` pin: by
notebook, on the HEAD's host). The notebook's next ``PUT /v1/kernels/{id}`` takes the copy: on the
same host the host's own answer tells; on another, the router adds ``left`` (when that sandbox
still exists) and takes the old host's row (``DELETE /v1/kernels-left``) so it is told once. Without
the copy (another router, a lost router.db) the host's row still tells on its own host, as before.
"""

from __future__ import annotations

import time
from urllib.parse import quote, urlencode

from .hosts import Host, HostError
from .router import Router

KIND = "kernel_left"


def key(notebook: str, caller=None) -> str:
    """Under JupyterHub two users' notebooks may share a path: each user's is their own."""
    return notebook if caller is None else f"{caller.name}\n{notebook}"


async def leave(router: Router, host: Host, kernel_id: str, caller=None,
                headers: dict | None = None) -> tuple[int, object]:
    """``POST /v1/kernels/{id}/leave`` on ``host``, the notebook's HEAD kept here too. The host's
    answer (204; 404 for a record it does not have); HostError if it is silent."""
    path, timeout = f"/v1/kernels/{quote(kernel_id, safe='')}", router.settings.host_timeout
    status, record = await host.request_json("GET", path, timeout=timeout, headers=headers)
    if status != 200 or not isinstance(record, dict):
        return status, record
    notebook = record.get("notebook")
    if isinstance(notebook, str) and notebook:  # kept before the host marks it: a crash between loses nothing
        router.state.pin(KIND, [(key(notebook, caller), {"head": record.get("head"), "kernel_id": kernel_id,
                                                          "left_at": time.time()})], host.url)
    return await host.request_json("POST", path + "/leave", timeout=timeout, headers=headers)


async def tell(router: Router, host: Host, notebook: str, caller, reply: dict) -> None:
    """Add to ``host``'s answer to the notebook's ``PUT /v1/kernels/{id}`` the HEAD its last kernel
    left, when the host did not (it is on another host), that is not the new HEAD and that its host
    still has (one gone or down cannot give the state back). Taken here and there: told once."""
    taken = router.state.take(KIND, key(notebook, caller))
    if taken is None or reply.get("left"):  # nothing kept, or told by the host that has it
        return
    url, left = taken
    old = router.hosts.get(url)
    if not left or not isinstance(left.get("head"), str) or url == host.url or old is None or not old.up:
        return
    head, timeout = left["head"], router.settings.host_timeout
    try:  # the host of that HEAD must not tell it again
        await old.request_json("DELETE", f"/v1/kernels-left?{urlencode({'notebook': notebook, 'head': head})}",
                               timeout=timeout)
        status, _ = await old.request_json("GET", f"/v1/sandboxes/{quote(head, safe='')}", timeout=timeout)
    except HostError:  # it cannot be said to still run
        return
    if status == 200 and head != reply.get("head"):
        reply["left"] = {**left, "host": url}
