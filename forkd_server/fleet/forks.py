"""A fork tree (``POST /v1/sandboxes/{id}/fork``) through the router.

On the source's host, when it has room for all the children: the host makes the tree. Hosts number
sandboxes per host (``sb-<second>-<n>``), so a fork on one host can hand out an id a sandbox on
another host already has. A spawn's clash is spawned again by the router (``Router.spawn_part``); a
fork's children are made by the host itself, so a clashing child is made again here, before the
fork is answered: killed on its host, and a new child spawned there from the fork's snapshot with
the same labels (its ``fork_tree_id`` among them, so the tree counts it) and memory limit. Nothing
ran in it yet, so the new child is the same copy of the snapshot.

Across hosts, when the source's host lacks room and the source is a VM (``fork_across``); a
process-engine source is refused (``host_local``). Its promote: promotes.py.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Any
from urllib.parse import quote

from ..controller.checks import HOST_MEMORY, MAX_CHILDREN
from ..controller.forktrees import OWNER_LABELS
from ..controller.wire import FORK_TREE_LABEL
from . import pending
from .hosts import Host, HostError
from .placement import Part
from .router import Refusal, Router
from .spawning import spawn_placed

log = logging.getLogger("forkd.router")


async def settle_children(router: Router, host: Host, reply: dict, headers: dict) -> tuple[int, Any]:
    """Pin the fork's children to ``host``, each under an id no other host uses; (201, the reply
    with its children as made) or, if a child could not be made again, that spawn's error with the
    fork's other children killed (a fork is all or nothing, as a spawn is)."""
    kids = [k for k in reply.get("sandboxes") or [] if isinstance(k, dict) and isinstance(k.get("id"), str)]
    taken = set(router.state.claim("sandbox", [(k["id"], k) for k in kids], host.url))
    clash = [k for k in kids if k["id"] in taken]
    good = [k for k in kids if k not in clash]
    if clash:
        snapshot = reply.get("snapshot") or {}
        log.warning("host %s forked children whose ids another host uses (%s): made again under new ids",
                    host.url, ", ".join(k["id"] for k in clash))
        await router.kill(host, [k["id"] for k in clash], unpin=False)  # their room is the new ones'
        first = clash[0]
        body = {"snapshot_tag": snapshot.get("tag") or first.get("snapshot_tag"), "n": len(clash),
                "labels": first.get("labels") or {}}
        if first.get("memory_limit_mib") is not None:
            body["memory_limit_mib"] = first["memory_limit_mib"]
        status, made = await router.spawn_part(Part(host.url, len(clash), False), body, headers)
        if status != 201:
            await router.kill(host, [k["id"] for k in good])
            return status, made
        good += [{k: v for k, v in m.items() if k != "host"} for m in made]
    reply["sandboxes"] = [{**k, "host": host.url} for k in good]
    return 201, reply


# --- a fork tree whose children span hosts -----------------------------------------------------------
#
# The source's host branches it (as its own fork does: live, else full) and the router places the
# children (spawning.py): the holder first, then other hosts, which pull the branch from the store
# (its host pushes it on demand). The children carry the tree's ``fork_tree_id`` label as a host's
# fork gives them; the tree's record (its members and their hosts) is the router's, kept with its
# pins, since no one host holds the whole tree.

TREE = "fork_tree"  # the router's pins of the trees it spans
FIELDS = {"count", "tag", "labels", "memory_limit_mib", "lossy"}  # a fork's body (forkd_server/handlers)


def fork_fields(body: dict | None) -> dict | None:
    """A fork's body as the router acts on it when the fork spans hosts, or None when it is not one
    a host takes as it is (the fork then goes to the host, which says what is wrong with it)."""
    if body is None:
        return None
    count, tag, labels = body.get("count"), body.get("tag"), body.get("labels")
    memory, lossy = body.get("memory_limit_mib"), body.get("lossy", False)
    count, memory = (int(v) if isinstance(v, float) and v.is_integer() else v for v in (count, memory))  # 3.0 counts
    if (isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CHILDREN
            or (tag is not None and not isinstance(tag, str))
            or (labels is not None and (not isinstance(labels, dict) or FORK_TREE_LABEL in labels))
            or (memory not in (None, HOST_MEMORY) and (isinstance(memory, bool) or not isinstance(memory, int)))
            or not isinstance(lossy, bool) or set(body) - FIELDS):
        return None
    return {"count": count, "tag": tag, "labels": labels or {}, "memory_limit_mib": memory, "lossy": lossy}


async def room_for(router: Router, host: Host, count: int) -> int | None:
    """How many of ``count`` children ``host`` has room for when that is fewer, by its capacity
    block read now; None when it has room for all, or states no cap."""
    if host.capacity is not None and host.capacity.max_sandboxes is None:
        return None  # no cap: nothing to read
    await router.refresh_capacity(host)
    free = host.capacity.free_slots if host.capacity else None
    return None if free is None or free >= count else free


def host_local(sandbox_id: str, host: Host, count: int, room: int) -> Refusal:
    """The refusal of a fork that cannot span hosts: the source runs on the process engine."""
    fit = f"fork at most {room} now (`%forkd fork -n {room}`), or " if room else ""
    return Refusal(503, f"sandbox {sandbox_id} runs on the process engine: a fork of it stays on its host "
                        f"{host.url}, which has room for {room} of the {count} children asked (--max-sandboxes)\n"
                        f"process-engine sandboxes and their branches are host-local and never move: {fit}end "
                        f"sandboxes on that host, or make the notebook movable: run it from a snapshot created "
                        f"with engine \"vm\" on hosts started with --store (a fork of it then spans hosts)",
                   capacity={"host": host.url, "room": room, "requested": count})


async def fork_across(router: Router, host: Host, sandbox_id: str, fork: dict, room: int,
                      headers: dict) -> tuple[int, Any]:
    """Fork ``sandbox_id`` (on ``host``, which has room for ``room`` children) into a tree whose
    children span hosts: (201, ``{"fork_tree_id", "snapshot", "sandboxes"}`` with each child's
    ``host``), or the answer of what failed, with nothing of the fork left behind. Recorded as
    pending before anything is made, so what a router killed mid-fork made is undone (settling.py)."""
    status, source = await host.request_json("GET", f"/v1/sandboxes/{quote(sandbox_id, safe='')}",
                                             timeout=router.settings.host_timeout, session="calls", headers=headers)
    if status != 200 or not isinstance(source, dict):
        return status, source
    count = fork["count"]
    if source.get("engine") != "vm":
        raise host_local(sandbox_id, host, count, room)
    tree_id = "ft-" + secrets.token_hex(5)
    tag = fork["tag"] or tree_id
    pending.begin(router, tree_id, host.url, sandbox_id, tag, fork["tag"] is not None)  # a crash from here: pending.py
    try:
        status, reply = await _make_tree(router, host, sandbox_id, fork, room, headers, tree_id, tag)
    except BaseException:  # a host that went away mid-way: what was made goes, as after a crash (settling.py)
        pending.abandon(router, tree_id)
        raise
    pending.end(router, tree_id)
    return status, reply


async def _make_tree(router: Router, host: Host, sandbox_id: str, fork: dict, room: int, headers: dict,
                     tree_id: str, tag: str) -> tuple[int, Any]:
    count = fork["count"]
    status, snap = await _branch(host, sandbox_id, tag, fork, headers)
    if status not in (200, 201) or not isinstance(snap, dict):
        return status, snap
    router.state.pin("snapshot", [(tag, None)], host.url, exclusive=False)
    body = {"snapshot_tag": tag, "n": count, "labels": {**fork["labels"], FORK_TREE_LABEL: tree_id}}
    if fork["memory_limit_mib"] is not None:
        body["memory_limit_mib"] = fork["memory_limit_mib"]
    try:
        status, kids = await spawn_placed(router, tag, count, body, headers)
    except Refusal as exc:
        status, kids = exc.status, {"error": exc.message, **exc.fields}
    except HostError as exc:
        status, kids = 502, {"error": str(exc), "host": exc.host}
    if status != 201:
        kept = "its snapshot stays (its tag is yours)" if fork["tag"] else await release(router, host, tag)
        error = kids.get("error") if isinstance(kids, dict) else repr(kids)[:200]
        return status, {**(kids if isinstance(kids, dict) else {}),
                        "error": f"fork of {sandbox_id} across hosts ({host.url} has room for {room} of {count}): "
                                 f"its children could not be placed, so none was kept and {kept}: {error}"}
    members = {k["id"]: k["host"] for k in kids}
    record = {"source": sandbox_id, "home": host.url, "snapshot_tag": tag, "user_tag": fork["tag"] is not None,
              "owners": owners({**(snap.get("labels") or {}), **fork["labels"]}), "members": members,
              "status": "open", "winner": None}
    router.state.pin(TREE, [(tree_id, record)], host.url)
    log.info("fork tree %s of %s spans %s", tree_id, sandbox_id, ", ".join(sorted(set(members.values()))))
    return 201, {"fork_tree_id": tree_id, "snapshot": {**snap, "host": host.url}, "sandboxes": kids}


def owners(labels: dict) -> dict:
    """Whose a sandbox is (its notebook labels), as a host's fork tree records them."""
    return {k: v for k, v in labels.items() if k in OWNER_LABELS}


async def _branch(host: Host, sandbox_id: str, tag: str, fork: dict, headers: dict) -> tuple[int, Any]:
    """The tree's snapshot, as a host's fork makes it: a live branch, a full one where live cannot be."""
    path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/branch"
    body = {"tag": tag, "mode": "live", "wait": True, "lossy": fork["lossy"], "labels": fork["labels"]}
    status, snap = await host.request_json("POST", path, body, timeout=None, session="calls", headers=headers)
    error = snap.get("error") if isinstance(snap, dict) else None
    if status == 400 and isinstance(error, str) and error.startswith("branch: ") and "live branch" in error:
        status, snap = await host.request_json("POST", path, {**body, "mode": "full"}, timeout=None,
                                               session="calls", headers=headers)
    return status, snap


async def release(router: Router, home: Host, tag: str) -> str:
    """Delete the tree's snapshot everywhere it went (its host, the hosts that pulled it, the store);
    what was done, said for an error message."""
    held, _ = await router.holders(tag)
    for url in held:
        with contextlib.suppress(HostError):
            await router.hosts[url].request_json("DELETE", f"/v1/snapshots/{quote(tag, safe='')}", timeout=60,
                                                 session="calls")
        router.state.unpin("snapshot", tag, url)
    with contextlib.suppress(HostError):  # pushed on demand for the pulls: 404 when it never was
        await home.request_json("DELETE", f"/v1/store/snapshots/{quote(tag, safe='')}", timeout=60, session="calls")
    return f"its snapshot {tag} was released"

