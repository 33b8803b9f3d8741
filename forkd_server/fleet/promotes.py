"""Promote of a fork tree whose children span hosts (forks.py makes such a tree): what a host's
promote does for a tree of its own (forkd_server/controller/forktrees.py), done across the hosts of its
members, from the tree's record the router keeps: the siblings killed on their hosts unless another
notebook, a workspace or ``cleanup_siblings: false`` keeps them, the tree's snapshot released from
every host and the store unless something keeps it, ``fork_tree_id`` taken off the survivors, and
the same answer."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from ..controller.forktrees import lost
from ..controller.wire import FORK_TREE_LABEL
from .forks import TREE, owners, release
from .hosts import Host, HostError
from .router import Refusal, Router


def spanned_tree(router: Router, sandbox_id: str, body: dict | None) -> tuple[str, dict] | None:
    """(id, record) of the tree a promote names (its ``tree_id``, else the winner's label) when it is
    one the router spans; None for a tree of one host (that host promotes it)."""
    tree_id = body.get("tree_id") if body else None
    if tree_id is None:
        tree_id = ((router.state.record("sandbox", sandbox_id) or {}).get("labels") or {}).get(FORK_TREE_LABEL)
    record = router.state.record(TREE, tree_id) if isinstance(tree_id, str) else None
    return (tree_id, record) if record is not None else None


_promoting: dict[str, asyncio.Lock] = {}  # tree id -> held while it is promoted (one promote at a time)


async def promote_across(router: Router, winner: str, tree_id: str, cleanup: bool,
                         headers: dict) -> tuple[int, Any]:
    """``winner`` wins its tree that spans hosts, as a host's promote decides it (forkd_server/
    forktrees.py): its siblings are killed on their hosts unless another notebook, a workspace or
    ``cleanup=False`` keeps them; the tree's snapshot goes from every host (and the store) unless a
    tag of the caller's, a kernel's base or another sandbox keeps it. Same answer as a host's."""
    lock = _promoting.setdefault(tree_id, asyncio.Lock())
    async with lock:
        tree = router.state.record(TREE, tree_id)
        members = tree["members"]
        if winner not in members:
            raise Refusal(400, f"sandbox {winner} is not in fork tree {tree_id}",
                          hint=f"its members: {', '.join(sorted(members)) or 'none'}")
        if tree["status"] == "promoted" and tree["winner"] != winner:
            raise Refusal(409, f"fork tree {tree_id} was promoted already: {tree['winner']} won it",
                          hint=f"fork {winner} again to start a new tree from it")
        tag = tree["snapshot_tag"]
        held, _ = await router.holders(tag)
        urls = [url for url in {*members.values(), *held} if url in router.hosts and router.hosts[url].up]
        try:
            seen = dict(zip(urls, await asyncio.gather(*(_holds(router.hosts[url]) for url in urls))))
        except HostError as exc:  # nothing was touched yet
            raise Refusal(502, f"promote of {winner} in fork tree {tree_id}, which spans hosts: {exc}",
                          host=exc.host) from None
        killed, kept, failed = await _drop_siblings(router, tree_id, tree, winner, seen, cleanup)
        released = await _release_snapshot(router, tree, {winner, *killed}, held, seen, kept)
        router.state.pin(TREE, [(tree_id, {**tree, "status": "promoted", "winner": winner})], tree["home"])
        await _close_labels(router, tree_id, members, seen, killed)
    host = router.hosts[members[winner]]
    status, info = await host.request_json("GET", f"/v1/sandboxes/{quote(winner, safe='')}",
                                           timeout=router.settings.host_timeout, session="calls", headers=headers)
    if status != 200:
        return status, info
    return 200, {"fork_tree_id": tree_id, "winner": {**info, "host": host.url}, "killed": killed,
                 "released": released, "kept": kept, "failed": failed}


async def _close_labels(router: Router, tree_id: str, members: dict, seen: dict, killed: list) -> None:
    """The tree is decided: its survivors are members of no open tree any more (their label goes)."""
    for sid, url in members.items():
        row = seen.get(url, {}).get("sandboxes", {}).get(sid)
        if sid in killed or row is None or (row.get("labels") or {}).get(FORK_TREE_LABEL) != tree_id:
            continue
        try:
            status, info = await router.hosts[url].request_json(
                "PATCH", f"/v1/sandboxes/{quote(sid, safe='')}", {"remove_labels": [FORK_TREE_LABEL]},
                timeout=60, session="calls")
        except HostError:
            continue  # a label left on is harmless: the tree's record says it is promoted
        if status == 200 and isinstance(info, dict):
            router.state.pin("sandbox", [(sid, info)], url)  # a promote without tree_id reads the label here


async def _holds(host: Host) -> dict:
    """What on ``host`` a promote must not take: the forkd kernels' HEADs and bases, the workspaces'
    sandboxes, and its sandboxes (id -> record)."""
    kernels, workspaces, sandboxes = await asyncio.gather(
        *(host.get_json(p, 30) for p in ("/v1/kernels", "/v1/workspaces", "/v1/sandboxes")))
    kernels = [k for k in kernels or [] if isinstance(k, dict)]
    who = {k.get("kernel_id"): (f"the notebook {k['notebook']}" if k.get("notebook") else
                                f"the forkd kernel {k.get('kernel_id')}") for k in kernels}
    return {"heads": {k.get("head"): who[k.get("kernel_id")] for k in kernels},
            "bases": {k.get("base_snapshot"): who[k.get("kernel_id")] for k in kernels if k.get("base_snapshot")},
            "workspaces": {w.get("live_sandbox_id"): w.get("name") for w in workspaces or [] if isinstance(w, dict)},
            "sandboxes": {s["id"]: s for s in sandboxes or [] if isinstance(s, dict) and "id" in s}}


async def _drop_siblings(router: Router, tree_id: str, tree: dict, winner: str, seen: dict, cleanup: bool):
    killed, kept, failed = [], [], []
    for sid, url in tree["members"].items():
        if sid == winner:
            continue
        if url not in seen:
            failed.append({"id": sid, "error": f"its host {url} is not up"})
            continue
        held = seen[url]
        row = held["sandboxes"].get(sid)
        if row is None:
            continue  # gone already
        now = owners(row.get("labels") or {})
        if sid in held["heads"]:
            why = f"it is the sandbox {held['heads'][sid]} runs in (its HEAD)"
        elif now != tree["owners"]:
            who = now.get("jupyter.notebook") or now.get("jupyter.kernel_id") or "someone else"
            why = f"it was taken over since the fork (now {who}'s)"
        elif sid in held["workspaces"]:
            why = f"it is the sandbox of workspace {held['workspaces'][sid]}"
        elif not cleanup:
            why = "cleanup_siblings is false"
        else:
            try:
                reason = quote(lost(tree_id, winner), safe="")  # its 404 says it, as a host's promote's
                status, body = await router.hosts[url].request_json(
                    "DELETE", f"/v1/sandboxes/{quote(sid, safe='')}?reason={reason}", timeout=60, session="calls")
            except HostError as exc:
                failed.append({"id": sid, "error": str(exc)})
                continue
            if status in (204, 404):
                router.state.unpin("sandbox", sid, url)
                killed += [sid] if status == 204 else []
            else:
                failed.append({"id": sid, "error": body.get("error") if isinstance(body, dict) else repr(body)[:200]})
            continue
        kept.append({"id": sid, "kind": "sandbox", "reason": why})
    return killed, kept, failed


async def _release_snapshot(router: Router, tree: dict, done: set[str], held: dict, seen: dict,
                            kept: list) -> list[str]:
    """The tree's snapshot released from every host holding it (and the store), unless something
    other than ``done`` (the winner, the siblings just killed) keeps it."""
    tag = tree["snapshot_tag"]
    if not held:
        return []
    users = [s for url in held if url in seen for s, row in seen[url]["sandboxes"].items()
             if row.get("snapshot_tag") == tag and s not in done]
    bases = [seen[url]["bases"][tag] for url in held if url in seen and tag in seen[url]["bases"]]
    down = [url for url in router.state.hosts_of("snapshot", tag) if url in router.hosts and url not in seen]
    why = ("its tag was given by the fork's caller" if tree["user_tag"] else
           f"it is the base snapshot of {bases[0]}" if bases else
           f"{', '.join(users)} {'was' if len(users) == 1 else 'were'} spawned from it" if users else
           f"its host {down[0]} is not up" if down else None)
    if why is not None:
        kept.append({"id": tag, "kind": "snapshot", "reason": why})
        return []
    home = router.hosts.get(tree["home"])
    await release(router, home if home is not None and home.up else router.hosts[next(iter(held))], tag)
    return [tag]
