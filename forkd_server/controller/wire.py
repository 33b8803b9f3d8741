"""The wire objects made from registry rows: forkd's SnapshotInfo and SandboxInfo, WorkspaceInfo,
and the lineage tree's nodes. One place decides what a client sees of a row."""

from __future__ import annotations

from ..errors import BadRequest

# The label of each child of a fork tree while the tree is open (forktrees.py): the tree's id.
FORK_TREE_LABEL = "fork_tree_id"


def pause_fields(pause_ms: float | None) -> dict:
    """A branch's pause as the wire carries it: ``pause_ms`` an integer, as forkd types it (u64),
    rounded up so that a real pause is never 0, and ``pause_us`` the precise figure in integer
    microseconds. The registry keeps the engine's float; metrics use it too."""
    if pause_ms is None:
        return {}
    us = round(pause_ms * 1000)
    if pause_ms > 0:
        us = max(us, 1)
    return {"pause_ms": -(-us // 1000), "pause_us": us}


def snapshot_info(row: dict) -> dict:
    info = {
        "tag": row["tag"],
        # where the snapshot lives: a directory for the VM engine, the template's socket for
        # the process engine (its memory is a parked process, not files)
        "dir": (row["handle"] or {}).get("dir") or (row["handle"] or {}).get("socket"),
        "created_at_unix": int(row["created_at"]),
        "status": row["status"],
        "bootable": row["status"] == "ready",
        "engine": row["engine"],
        "lineage": row["lineage"],
    }
    if row["branched_from"]:
        info["branched_from"] = row["branched_from"]
    info.update(pause_fields(row["pause_ms"]))
    if row["prepare_ms"]:
        info["prepare_ms"] = row["prepare_ms"]
    if row["warning"]:
        info["warning"] = row["warning"]
    if row.get("warnings"):  # what a lossy fork left behind, for as long as the snapshot lives
        info["warnings"] = row["warnings"]
    info["labels"] = row.get("labels") or {}
    stored = _stored(row)
    if stored:  # kept in the local store (durable across reboots); remote: pushed to this server's store
        info["stored"] = stored
    return info


def sandbox_info(row: dict) -> dict:
    handle = row["handle"] or {}
    return {
        "id": row["id"],
        "snapshot_tag": row["snapshot_tag"],
        "netns": None,
        "guest_addr": f"unix:{handle['socket']}" if handle.get("socket") else None,
        "created_at_unix": int(row["created_at"]),
        "pid": handle.get("pid"),
        "memory_limit_mib": row["memory_limit_mib"],
        "has_branched": row["branch_count"] > 0,
        "last_branch_memory_path": None,
        "branch_count": row["branch_count"],
        "engine": row["engine"],
        "status": row["status"],
        "lineage": row["lineage"],
        "labels": row.get("labels") or {},
        # running, frozen (paused, no CPU) or stored (in the store, no process): tiers.py
        "tier": row.get("tier") or "running",
    }


def workspace_info(row: dict) -> dict:
    info = {
        "id": row["id"],
        "name": row["name"],
        "source_snapshot_tag": row["source_snapshot_tag"],
        "status": row["status"],
        "created_at_unix": int(row["created_at"]),
        "last_active_unix": int(row["last_active"]),
        "memory_limit_mib": row["memory_limit_mib"],
    }
    for key in ("current_state_tag", "live_sandbox_id", "last_branch_memory_path", "labels"):  # forkd has none
        if row[key]:
            info[key] = row[key]
    return info


def _stored(row: dict) -> dict | None:
    stored = (row["handle"] or {}).get("stored")
    return {"digest": stored["digest"], "remote": bool(stored.get("remote"))} if stored else None


def tree_nodes(snapshots: list[dict], sandboxes: list[dict]) -> list[dict]:
    """Every snapshot and running sandbox as a node with a parent id (None for roots) and the whole
    lineage (root ... itself), so a front end can draw ancestors that are gone."""
    nodes = []
    for s in snapshots:
        nodes.append({"id": s["tag"], "kind": "snapshot", "parent": s["lineage"][-2] if len(s["lineage"]) > 1 else None,
                      "status": s["status"], "pause_ms": None, "pause_us": None, **pause_fields(s["pause_ms"]),
                      "created_at": s["created_at"], "engine": s["engine"], "lineage": s["lineage"],
                      "labels": s.get("labels") or {}, "warnings": s.get("warnings") or [],
                      **({"stored": _stored(s)} if _stored(s) else {})})
    for b in sandboxes:
        if b["status"] == "running":
            nodes.append({"id": b["id"], "kind": "sandbox", "parent": b["snapshot_tag"], "status": "running",
                          "pause_ms": None, "pause_us": None, "created_at": b["created_at"], "engine": b["engine"],
                          "lineage": b["lineage"], "labels": b.get("labels") or {},
                          "tier": b.get("tier") or "running"})
    return nodes


def label_filter(selectors: list[str]) -> dict[str, str]:
    """``["k=v", ...]`` (the repeatable ``?label=`` query) as a dict; every pair must match."""
    wanted = {}
    for selector in selectors:
        key, sep, value = selector.partition("=")
        if not sep or not key:
            raise BadRequest(f"label filter {selector!r} must be key=value, e.g. ?label=jupyter.kernel_id=abc")
        wanted[key] = value
    return wanted


def has_labels(labels: dict | None, wanted: dict[str, str]) -> bool:
    labels = labels or {}
    return all(labels.get(k) == v for k, v in wanted.items())
