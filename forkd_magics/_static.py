"""A static picture of the lineage tree, put in the widget's output bundle next to the live view.

A saved notebook shown without its kernel (nbviewer, GitHub, nbconvert) cannot run the widget's
JavaScript; it shows this picture instead. The bundle holds it twice: as ``image/svg+xml``, and as
``text/html`` (an ``<img>`` of the same SVG), because JupyterLab renders an untrusted notebook's
outputs (one opened from elsewhere, or run by nbconvert) only through its safe renderers, which are
HTML (sanitized: an ``<img>`` with a ``data:`` URI passes), images other than SVG, and text; with
only the SVG it fell back to the text, ``LineageWidget(...)``. It is drawn in Python at display time (the kernel has no
JavaScript engine) and follows the live drawing's rules (``lineage.js``): one row per node, a ghost
for every ancestor that is gone, alike leaf siblings folded into one row from ``GROUP_MIN`` on, each
node's host named when the tree spans more than one (behind a fleet's router).
Its colours are fixed and it carries its own white background, so it reads on any page.
"""

from __future__ import annotations

import base64
from xml.sax.saxutils import escape, quoteattr

GROUP_MIN = 4  # as lineage.js
ROW, INDENT, WIDTH, PAD, HEADER = 30, 18, 600, 8, 36
COLOURS = {"ready": "#1a7f37", "running": "#0969da", "writing": "#bf8700", "failed": "#cf222e", "lost": "#cf222e"}
GONE = {"sandbox": "killed", "snapshot": "deleted"}


def with_ghosts(tree: dict) -> dict:
    """Add a ghost node for every ancestor that is gone (see ``withGhosts`` in lineage.js)."""
    out = dict(tree)
    for node in tree.values():
        chain = node.get("lineage") or []
        kind, parent = node["kind"], node.get("parent")
        while parent and (parent not in out or out[parent].get("ghost")):
            at = chain.index(parent) if parent in chain else -1
            grand = chain[at - 1] if at > 0 else None
            kind = "snapshot" if kind == "sandbox" else "sandbox"
            known = out.get(parent)
            if known is not None and (known.get("parent") or not grand):
                break
            out[parent] = {"kind": kind, "parent": grand, "status": GONE[kind], "ghost": True}
            parent = grand
    return out


def rows(tree: dict) -> list[tuple[int, str, str | None, list[str]]]:
    """(depth, node id or None for a group, status, member ids) top to bottom, groups folded."""
    kids: dict[str, list[str]] = {}
    roots = []
    for nid, node in tree.items():
        parent = node.get("parent")
        (kids.setdefault(parent, []) if parent in tree and parent != nid else roots).append(nid)
    def order(ids):
        return sorted(ids, key=lambda i: (tree[i].get("created") is None, tree[i].get("created") or 0, i))
    out = []

    def place(nid, depth):
        out.append((depth, nid, tree[nid]["status"], [nid]))
        children = order(kids.get(nid, []))
        buckets: dict[tuple, list[str]] = {}
        for c in children:
            n = tree[c]
            if not kids.get(c) and not n.get("heads") and not (n.get("warnings") or n.get("warning")):
                buckets.setdefault((n["kind"], n["status"]), []).append(c)
        grouped = {c: key for key, ids in buckets.items() if len(ids) >= GROUP_MIN for c in ids}
        seen = set()
        for c in children:
            key = grouped.get(c)
            if key is None:
                place(c, depth + 1)
            elif key not in seen:
                seen.add(key)
                out.append((depth + 1, None, key[1], buckets[key]))

    for r in order(roots):
        place(r, 0)
    return out


def hosts_of(tree: dict) -> list[str]:
    """The hosts a tree's nodes are on (behind a fleet's router), sorted (see ``hostsOf`` in
    lineage_tree.js): a node names its host only when there is more than one."""
    seen = set()
    for node in tree.values():
        if not node.get("ghost"):
            seen.update(node.get("hosts") or ([node["host"]] if node.get("host") else []))
    return sorted(seen)


def host_label(url: str) -> str:
    """A host's URL as shown: without the scheme (10.0.0.2:8889)."""
    return url.split("://", 1)[-1].rstrip("/")


def static_bundle(tree: dict) -> dict[str, str]:
    """The picture as the mime types a page without the widget can show (see the module's doc)."""
    svg = static_svg(tree)
    alt = f"forkd lineage: {_counts(tree)} when the cell ran"
    src = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode("ascii")
    return {"image/svg+xml": svg, "text/html": f"<img src={quoteattr(src)} alt={quoteattr(alt)}>"}


def _counts(tree: dict) -> str:
    live = [n for n in tree.values() if not n.get("tomb")]
    snaps = sum(1 for n in live if n["kind"] == "snapshot")
    gone = len(tree) - len(live)
    hosts = len(hosts_of(tree))
    return (f"{snaps} snapshot(s), {len(live) - snaps} sandbox(es)" + (f" on {hosts} hosts" if hosts > 1 else "")
            + (f", {gone} gone" if gone else ""))


def static_svg(tree: dict) -> str:
    """The tree as a standalone SVG document (a string); nothing in it depends on the clock, so a
    notebook's stored picture compares equal when it is run again (nbval)."""
    full = with_ghosts(tree)
    drawn = rows(full)
    height = PAD * 2 + HEADER + max(len(drawn), 1) * ROW
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="#ffffff" stroke="#c8ccd1"/>',
           f'<text x="{PAD}" y="{PAD + 12}" fill="#57606a" font-size="11">forkd lineage: {_counts(tree)} '
           f'when the cell ran</text>',
           f'<text x="{PAD}" y="{PAD + 26}" fill="#57606a" font-size="11">a static picture: run the cell for the '
           f'live view</text>']
    top = PAD + HEADER
    hosts = hosts_of(full)
    index: dict[str, int] = {}
    for i, (depth, nid, status, members) in enumerate(drawn):
        y = top + i * ROW
        x = PAD + depth * INDENT
        if nid is not None:
            index[nid] = i
            parent = full[nid].get("parent")
        else:
            parent = full[members[0]].get("parent")
        if parent in index:
            px = PAD + drawn[index[parent]][0] * INDENT + 8
            out.append(f'<path d="M{px},{top + index[parent] * ROW + 24} V{y + 12} H{x}" fill="none" stroke="#9aa4b1"/>')
        colour = COLOURS.get(status, "#8c959f")
        ghost = nid is not None and (full[nid].get("ghost") or full[nid].get("tomb"))
        stale = nid is not None and full[nid].get("unanswered")  # its host did not answer: as last seen
        dash = ' stroke-dasharray="4 3"' if ghost or nid is None else ' stroke-dasharray="1 2"' if stale else ""
        out.append(f'<rect x="{x}" y="{y}" width="{WIDTH - PAD - x}" height="24" rx="3" fill="#ffffff" stroke="#c8ccd1"{dash}/>')
        out.append(f'<rect x="{x}" y="{y}" width="4" height="24" fill="{colour}"/>')
        if nid is None:
            label = f"{len(members)} × {status} ({'snapshots' if full[members[0]]['kind'] == 'snapshot' else 'sandboxes'})"
        else:
            node = full[nid]
            icon = "◆" if node["kind"] == "snapshot" else "●"
            hist = " → ".join(node.get("history") or [status])
            extra = " (gone)" if node.get("ghost") else ""
            if node.get("pause_ms") is not None:
                extra += f" · paused {node['pause_ms']:.2f} ms"
            warns = node.get("warnings") or ([node["warning"]] if node.get("warning") else [])
            if warns:
                extra += f" · ⚠ {len(warns)} warning(s)"
            if node.get("heads"):
                extra += f" · HEAD of {', '.join(node['heads'])}"
            if len(hosts) > 1 and not node.get("ghost") and (node.get("hosts") or node.get("host")):
                held = node.get("hosts") or [node["host"]]
                extra += f" · on {host_label(held[0]) if len(held) == 1 else f'{len(held)} hosts'}"
            if stale:
                extra += " · as last seen (its host did not answer)"
            label = f"{icon} {nid} · {hist}{extra}"
        out.append(f'<text x="{x + 10}" y="{y + 16}" fill="#1f2328">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)
