// forkd lineage, the pure part: ghosts for gone ancestors, the rows to draw (alike siblings folded),
// counts, and what a kill or delete takes along. No DOM: the tests run it under node. Used by the
// drawing (lineage.js), hence by the JupyterLab panel and the widget.
//
// A tree is {id: node}; a node is {kind: "snapshot"|"sandbox", parent, lineage?, status, history?,
// created?, engine?, pause_ms?, warnings?, warning?, memory?: {uss_kib}, labels?, heads?: [notebook],
// host?, hosts?: [url], info?}. `host` is set behind a fleet's router (the host that holds a sandbox;
// for a snapshot, the first of `hosts`, every host that holds it). `parent` may name a node that is gone: withGhosts puts a ghost there, so lineage never
// breaks.

export const GROUP_MIN = 4; // this many alike leaf siblings fold into one row
export const ROW = 46; // px per row (the rows have a fixed height: edges are drawn from indices)
export const INDENT = 16; // px per generation, for the first DEEP generations
export const DEEP = 4;
export const INDENT_DEEP = 8; // px per generation past DEEP: a deep lineage leaves the rows their width
export const ROW_MIN = 160; // px: the narrowest row (icon, an id with its tail, a chip); the tree scrolls sideways past it
export const indentOf = (depth) => Math.min(depth, DEEP) * INDENT + Math.max(0, depth - DEEP) * INDENT_DEEP;
export const GONE = { sandbox: "killed", snapshot: "deleted" };
export const MODES = ["live", "diff", "full"];

export function age(created, now) {
  if (created === null || created === undefined) return "";
  const s = Math.max(0, Math.floor(now - created));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function fmtMs(ms) {
  if (ms === null || ms === undefined) return "";
  return ms < 10 ? `${Number(ms).toFixed(2)} ms` : `${Number(ms).toFixed(0)} ms`;
}

export function fmtKib(kib) {
  if (kib === null || kib === undefined) return "";
  if (kib < 1024) return `${kib} KiB`;
  if (kib < 1024 * 1024) return `${(kib / 1024).toFixed(1)} MiB`;
  return `${(kib / 1024 / 1024).toFixed(2)} GiB`;
}

export const plural = (n, one, many) => `${n} ${n === 1 ? one : many || one + "s"}`;
export const isGone = (node) => !!node && (node.ghost || node.status === GONE[node.kind] || node.tomb);
export const warningsOf = (node) =>
  (node.warnings && node.warnings.length ? node.warnings : node.warning ? [node.warning] : []);

// Complete a tree with a ghost for every ancestor that is gone (a deleted snapshot above running
// sandboxes, a killed sandbox above its branches). A node's lineage (root ... itself) gives the
// ghost's own parent, so a chain of missing ancestors becomes a chain of ghosts up to a live node.
export function withGhosts(tree) {
  const out = { ...tree };
  for (const [id, node] of Object.entries(tree)) {
    const chain = node.lineage || [];
    let kind = node.kind;
    let parent = node.parent;
    while (parent) {
      const at = chain.indexOf(parent);
      const grand = at > 0 ? chain[at - 1] : null;
      const known = out[parent];
      if (known && !known.ghost) break;
      kind = kind === "sandbox" ? "snapshot" : "sandbox";
      if (known) { // a ghost already made from a child that knew less
        if (known.parent || !grand) break;
        out[parent] = { ...known, parent: grand };
      } else {
        out[parent] = { kind, parent: grand, status: GONE[kind], ghost: true, lineage: at >= 0 ? chain.slice(0, at + 1) : null };
      }
      parent = grand;
    }
  }
  return out;
}

export function childrenOf(tree) {
  const kids = {};
  const roots = [];
  const order = (a, b) => {
    const ca = tree[a].created ?? Infinity, cb = tree[b].created ?? Infinity;
    return ca === cb ? (a < b ? -1 : a > b ? 1 : 0) : ca - cb;
  };
  for (const id of Object.keys(tree)) {
    const p = tree[id].parent;
    if (p && tree[p] && p !== id) (kids[p] = kids[p] || []).push(id);
    else roots.push(id);
  }
  for (const k of Object.keys(kids)) kids[k].sort(order);
  return { kids, roots: roots.sort(order) };
}

// The hosts a tree's nodes are on (behind a fleet's router), sorted; empty for one server. The
// drawing names a node's host only when there is more than one to tell apart.
export function hostsOf(tree) {
  const seen = new Set();
  for (const node of Object.values(tree)) {
    if (node.ghost) continue;
    for (const h of node.hosts && node.hosts.length ? node.hosts : node.host ? [node.host] : []) seen.add(h);
  }
  return [...seen].sort();
}

// A host's URL as it is shown: without the scheme (10.0.0.2:8889).
export const hostLabel = (url) => String(url).replace(/^[a-z]+:\/\//i, "").replace(/\/+$/, "");

function matches(id, node, q) {
  if (!q) return false;
  const hay = [id, node.engine, ...(node.hosts || [node.host]).map((h) => h && hostLabel(h)),
    ...Object.entries(node.labels || {}).map(([k, v]) => `${k}=${v}`)];
  return hay.some((s) => s && String(s).toLowerCase().includes(q));
}

// The rows to draw, top to bottom: {type: "node", id, depth, up} or {type: "group", key, ids, kind,
// status, depth, up, open}; `up` is the index of the row the edge comes from (-1 for roots).
// With a query (or a host's filter `only(id, node)`), only the nodes that pass and their ancestors
// are drawn. Alike leaves (same kind and status, without children) fold into a group unless the
// group is in `expanded`; `keep` never folds.
export function rows(tree, { expanded = new Set(), query = "", keep = new Set(), only = null } = {}) {
  const { kids, roots } = childrenOf(tree);
  const q = query.trim().toLowerCase();
  let visible = null;
  if (q || only) {
    visible = new Set();
    for (const [id, node] of Object.entries(tree)) {
      if ((only && !only(id, node)) || (q && !matches(id, node, q))) continue;
      for (let a = id; a && tree[a] && !visible.has(a); a = tree[a].parent) visible.add(a);
    }
  }
  const shown = (id) => !visible || visible.has(id);
  const out = [];
  const place = (id, depth, up) => {
    const me = out.length;
    out.push({ type: "node", id, depth, up });
    const cs = (kids[id] || []).filter(shown);
    const buckets = {};
    for (const c of cs) {
      const n = tree[c];
      const leaf = !(kids[c] || []).some(shown);
      if (!leaf || keep.has(c) || (q && matches(c, n, q)) || (n.heads && n.heads.length) || warningsOf(n).length) continue;
      (buckets[`${id}|${n.kind}|${n.status}`] = buckets[`${id}|${n.kind}|${n.status}`] || []).push(c);
    }
    const groupOf = {};
    for (const [key, ids] of Object.entries(buckets)) if (ids.length >= GROUP_MIN) for (const c of ids) groupOf[c] = key;
    const done = new Set();
    for (const c of cs) {
      const key = groupOf[c];
      if (!key) { place(c, depth + 1, me); continue; }
      if (done.has(key)) continue;
      done.add(key);
      const ids = buckets[key];
      const open = expanded.has(key);
      out.push({ type: "group", key, ids, kind: tree[c].kind, status: tree[c].status, depth: depth + 1, up: me, open });
      if (open) for (const m of ids) out.push({ type: "node", id: m, depth: depth + 1, up: me });
    }
  };
  for (const r of roots.filter(shown)) place(r, 0, -1);
  return out;
}

// Counts for headers and the status bar: live snapshots and sandboxes, private memory in all.
export function summary(tree) {
  let snapshots = 0, sandboxes = 0, kib = 0, known = 0;
  for (const node of Object.values(tree)) {
    if (isGone(node)) continue;
    if (node.kind === "snapshot") snapshots++;
    else sandboxes++;
    if (node.memory && node.memory.uss_kib !== undefined) { kib += node.memory.uss_kib; known++; }
  }
  return { snapshots, sandboxes, memory_kib: known ? kib : null };
}

function descendants(tree, id) {
  const { kids } = childrenOf(tree);
  const out = [];
  const walk = (x) => { for (const c of kids[x] || []) { out.push(c); walk(c); } };
  walk(id);
  return out;
}

const listed = (ids, max = 4) => ids.slice(0, max).join(", ") + (ids.length > max ? `, … (${ids.length - max} more)` : "");

// What else goes when a sandbox is killed: {title, body: [lines], ok}.
export function describeKill(tree, id) {
  const node = tree[id] || {};
  const mem = node.memory && node.memory.uss_kib !== undefined ? ` (${fmtKib(node.memory.uss_kib)} private)` : "";
  const body = [`${id} stops now: its memory${mem} and any work in progress are lost.`];
  const branches = descendants(tree, id).filter((d) => tree[d].kind === "snapshot" && !isGone(tree[d]));
  body.push(branches.length
    ? `The ${plural(branches.length, "snapshot")} branched from it stay${branches.length === 1 ? "s" : ""} (${listed(branches)}); the tree shows ${id} as a ghost above them.`
    : "No snapshot was branched from it: nothing else goes.");
  if (node.heads && node.heads.length) {
    body.push(`It is the HEAD of ${node.heads.join(", ")}: check out another sandbox there before running the next cell.`);
  }
  return { title: `Kill sandbox ${id}?`, body, ok: "Kill" };
}

// What else goes when a snapshot is deleted: {title, body, ok, option} (option: cascade).
export function describeDelete(tree, tag) {
  const below = descendants(tree, tag).filter((d) => !isGone(tree[d]));
  const sandboxes = below.filter((d) => tree[d].kind === "sandbox");
  const direct = sandboxes.filter((d) => tree[d].parent === tag);
  const snaps = below.filter((d) => tree[d].kind === "snapshot");
  const body = [`The snapshot ${tag} is deleted; nothing can be forked from it any more.`];
  body.push(direct.length
    ? `The ${plural(direct.length, "sandbox", "sandboxes")} forked from it keep${direct.length === 1 ? "s" : ""} running (${listed(direct)}); the tree shows ${tag} as a ghost above them.`
    : "No sandbox forked from it is running.");
  if (snaps.length) {
    body.push(`${plural(snaps.length, "snapshot")} branched further down stay${snaps.length === 1 ? "s" : ""} unless you tick the box: ${listed(snaps)}.`);
  }
  return {
    title: `Delete snapshot ${tag}?`, body, ok: "Delete",
    option: snaps.length ? { name: "cascade", label: `Also delete the ${plural(snaps.length, "snapshot")} branched further down (cascade)` } : null,
  };
}
