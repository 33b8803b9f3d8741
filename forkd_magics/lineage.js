// forkd lineage: one drawing of snapshots and sandboxes, shared by the JupyterLab panel (forkd-lab
// bundles this file) and the anywidget widget (lineage_widget.js). Plain ESM, nothing fetched.
//
// The drawing is an indented tree (one row per node, generations indented), which stays readable in
// a 300 px sidebar and grows by one row per node; siblings that are alike fold into one row
// ("20 × running"); gone ancestors are ghosts; killed and deleted nodes stay as tombstones until
// cleared. Behind a fleet's router, whose nodes carry their `host`, each row names its host once
// the tree spans more than one (one host needs no name). Colours are JupyterLab's --jp-* variables
// (lineage.css).

import { GONE, MODES, ROW, ROW_MIN, age, describeDelete, describeKill, fmtKib, fmtMs, hostLabel, hostsOf, isGone, plural,
  indentOf, rows, summary, warningsOf, withGhosts } from "./lineage_tree.js";

export * from "./lineage_tree.js";

function el(tag, attrs, parent, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : String(v));
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

// A node's host chip: a sandbox's host, a snapshot's (or how many hold it, each named in the title).
function hostChip(parent, node) {
  const hosts = node.hosts && node.hosts.length ? node.hosts : node.host ? [node.host] : [];
  if (!hosts.length) return null;
  const text = hosts.length > 1 ? `${hosts.length} hosts` : hostLabel(hosts[0]);
  const title = hosts.length > 1 ? `held by ${hosts.length} hosts: ${hosts.map(hostLabel).join(", ")}` : `on host ${hosts[0]}`;
  return el("span", { class: "forkd-chip forkd-host", title, "data-host": hosts.join(" ") }, parent, text);
}

// A sandbox's tier, said where it shows (running needs no word).
const TIER_TITLES = {
  frozen: "paused, its memory kept, no CPU used; the next call wakes it",
  stored: "its state is in the store, no process and no RAM; the next call wakes it, same id"
};

// Put `fresh` (elements, each with its `_sig`: its drawing when built) into `parent`, keeping an
// element already there under the same key whose drawing is the same. Every live update redraws
// the view, and a control replaced between the press and the release of a click loses the click:
// so one holding `held.el` (what a pointer pressed and has not released) stays as it is drawn, and
// `held.stale` says a redraw is owed once it is released.
function reconcile(parent, fresh, keyOf, held) {
  const old = new Map();
  for (const c of parent.children) if (c._sig !== undefined) old.set(keyOf(c), c);
  const next = fresh.map((f) => {
    const o = old.get(keyOf(f));
    if (!o || o._sig === f._sig) return o || f;
    if (held.el && o.contains(held.el)) {
      held.stale = true;
      return o;
    }
    return f;
  });
  const keep = new Set(next);
  // what it did not draw stays (the widget's confirmation box, open under the details)
  for (const c of [...parent.children]) if (c._sig !== undefined && !keep.has(c)) c.remove();
  let at = parent.firstElementChild;
  for (const e of next) {
    if (e === at) at = at.nextElementSibling;
    else parent.insertBefore(e, at);
  }
  return next;
}

function signed(e) {
  e._sig = e.outerHTML;
  return e;
}

function svgEl(tag, attrs, parent) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (parent) parent.appendChild(e);
  return e;
}

// An id that may not fit: the end stays visible (sb-6b04…cf50-0001), since ids differ at their end.
function idLabel(parent, id) {
  const box = el("span", { class: "forkd-id", title: id }, parent);
  const cut = id.length > 12 ? id.length - 7 : id.length;
  el("span", { class: "forkd-id-head" }, box, id.slice(0, cut));
  if (cut < id.length) el("span", { class: "forkd-id-tail" }, box, id.slice(cut));
  return box;
}

// The drawing with its toolbar (search, zoom, fit), connection state, details and actions.
// Hosts pass: act(action, id, args) -> Promise<message> (throws to report an error);
// confirm({title, body, ok, option}) -> Promise<{ok, option}> (default: inline, in the view);
// extraActions(id, node) -> [{label, title, disabled, run: () => Promise<message>}];
// copy(text) -> Promise; toolbar: an element placed in the toolbar; fill: take the host's height;
// clearGone() -> the host keeps killed and deleted nodes in its tree itself (marked `tomb`, as the
// widget's kernel does, so a view drawn after they went still shows them) and forgets them here.
export class LineageView {
  constructor(host, opts = {}) {
    this.opts = opts;
    this.tree = {};
    this.tombs = {};
    this.selected = null;
    this.expanded = new Set();
    this.query = "";
    this.zoom = 1;
    this.state = "live";
    this.busy = false;
    this.choice = { id: null }; // what the user set in the selected node's actions (count, branch mode)
    this.only = null;
    this.onlyEmpty = "";
    this.root = el("div", { class: `forkd-lineage${opts.fill ? " forkd-fill" : ""}` }, host);
    const bar = el("div", { class: "forkd-bar" }, this.root);
    this.head = el("span", { class: "forkd-head" }, bar);
    this.search = el("input", { type: "search", class: "forkd-search", placeholder: "tag or id", "aria-label": "Search snapshots and sandboxes by tag or id" }, bar);
    this.search.addEventListener("input", () => { this.query = this.search.value; this.render(); });
    if (opts.toolbar) bar.appendChild(opts.toolbar);
    const tool = (label, title, fn) => {
      const b = el("button", { class: "forkd-tool", title, "aria-label": title, type: "button" }, bar, label);
      b.addEventListener("click", fn);
      return b;
    };
    tool("−", "Zoom out", () => this.setZoom(this.zoom / 1.25));
    tool("+", "Zoom in", () => this.setZoom(this.zoom * 1.25));
    tool("⤢", "Fit the whole tree", () => this.fit());
    this.clearBtn = tool("", "Forget killed sandboxes and deleted snapshots", () => {
      this.tombs = {};
      if (this.opts.clearGone) {
        this.tree = Object.fromEntries(Object.entries(this.tree).filter(([, n]) => !n.tomb));
        this.opts.clearGone();
      }
      this.render();
    });
    this.stateLine = el("div", { class: "forkd-state", role: "status", "aria-live": "polite" }, this.root);
    this.canvas = el("div", { class: "forkd-canvas" }, this.root);
    this.content = el("div", { class: "forkd-content" }, this.canvas);
    this.edges = svgEl("svg", { class: "forkd-edges", "aria-hidden": "true" }, this.content);
    this.list = el("div", { class: "forkd-rows", role: "tree", "aria-label": "forkd lineage" }, this.content);
    this.details = el("div", { class: "forkd-details" }, this.root);
    this.msg = el("div", { class: "forkd-message", "aria-live": "polite" }, this.root);
    this.held = { el: null, stale: false };
    this._holdStill();
    this.list.addEventListener("keydown", (e) => this._key(e));
    this.canvas.addEventListener("wheel", (e) => {
      if (!e.ctrlKey) return;
      e.preventDefault();
      this.setZoom(this.zoom * (e.deltaY < 0 ? 1.1 : 1 / 1.1));
    }, { passive: false });
    this._pan();
    this.timer = setInterval(() => this._tick(), 1000);
    this.render();
  }

  dispose() {
    clearInterval(this.timer);
    this.root.remove();
  }

  // A new tree from the host. Nodes that left it stay as tombstones (killed / deleted), so a kill
  // is seen, not just a row vanishing; "forget" clears them. A host that keeps them itself
  // (clearGone) sends them marked `tomb`; what it drops then is gone from the drawing too.
  update(tree) {
    const now = Date.now() / 1000;
    for (const [id, node] of Object.entries(this.opts.clearGone ? {} : this.tree)) {
      if (tree[id] || node.ghost || this.tombs[id]) continue;
      const status = GONE[node.kind];
      // a gone sandbox is nobody's HEAD any more (its kernel's record may still name it)
      this.tombs[id] = { ...node, status, tomb: true, heads: [], history: [...(node.history || [node.status]), status], gone_at: now };
    }
    for (const id of Object.keys(this.tombs)) if (tree[id]) delete this.tombs[id];
    this.tree = tree;
    this.render();
  }

  // The host's connection: "live", "reconnecting", "disconnected" (with a reconnect callback), "error".
  setState(state, text = "", reconnect = null) {
    this.state = state;
    this.stateText = text;
    this.reconnect = reconnect;
    this.render();
  }

  setMessage(text, error = false) {
    this.msg.textContent = text || "";
    this.msg.classList.toggle("forkd-error", !!error);
  }

  setZoom(z) {
    this.zoom = Math.min(2, Math.max(0.4, z));
    this.content.style.zoom = String(this.zoom);
  }

  fit() {
    this.setZoom(1);
    const h = this.list.scrollHeight, w = this.list.scrollWidth;
    const z = Math.min(1, this.canvas.clientHeight / Math.max(h, 1), this.canvas.clientWidth / Math.max(w, 1));
    this.setZoom(z);
    this.canvas.scrollTo(0, 0);
  }

  select(id) {
    this.selected = id;
    this.render();
  }

  // A host's filter (the panel's "this notebook"): only(id, node) -> bool, or null for all.
  // Takes effect at the next render; `empty` is what to say when nothing passes.
  setOnly(only, empty = "") {
    this.only = only;
    this.onlyEmpty = empty;
  }

  // everything drawn: the host's tree, the tombstones under it, ghosts for what is missing
  shownTree() {
    const t = { ...this.tombs, ...this.tree };
    return withGhosts(t);
  }

  render() {
    const tree = this.shownTree();
    const all = Object.values(tree);
    // the counts are of what the host's filter lets through ("this notebook"), not of nodes it hides
    const s = summary(this.only ? Object.fromEntries(Object.entries(tree).filter(([id, n]) => this.only(id, n))) : tree);
    this.hosts = hostsOf(tree);
    this.head.textContent = `${plural(s.snapshots, "snapshot")} · ${plural(s.sandboxes, "sandbox", "sandboxes")}` +
      (this.hosts.length > 1 ? ` · ${this.hosts.length} hosts` : "") + (s.memory_kib !== null ? ` · ${fmtKib(s.memory_kib)}` : "");
    this.head.title = this.hosts.length > 1 ? `on ${this.hosts.map(hostLabel).join(", ")}` : "";
    if (this.state === "live") el("span", { class: "forkd-live", title: "following the server's changes" }, this.head, " · ● live");
    const tombs = all.filter((n) => n.tomb).length;
    this.clearBtn.textContent = `clear gone (${tombs})`;
    this.clearBtn.hidden = tombs === 0;
    this._drawState();
    const keep = new Set([this.selected]);
    this.shownRows = rows(tree, { expanded: this.expanded, query: this.query, keep, only: this.only });
    this._drawRows(tree, this.shownRows);
    this._drawDetails(tree);
    this._tick(); // the ages of the rows and details just drawn
    if (!this.shownRows.length) {
      const why = !all.length ? this.opts.empty || "No snapshots yet."
        : this.query.trim() ? `Nothing matches “${this.query.trim()}”.` : this.onlyEmpty || "Nothing to show.";
      el("div", { class: "forkd-empty" }, this.list, why);
      this.list.style.height = "auto";
    }
  }

  _drawState() {
    const line = this.stateLine;
    const sig = `${this.state}|${this.stateText}|${!!this.reconnect}`;
    if (line._sig === sig) return; // its Reconnect button stays the one under the pointer
    line._sig = sig;
    line.textContent = "";
    line.dataset.state = this.state;
    if (this.state === "live" && !this.stateText) { line.hidden = true; return; }
    line.hidden = false;
    const label = { live: "● live ·", loading: "○ connecting…", reconnecting: "○ reconnecting…", disconnected: "○ disconnected",
      error: "⚠" }[this.state] || this.state;
    el("span", { class: "forkd-state-label" }, line, label);
    if (this.stateText) el("span", { class: "forkd-state-text" }, line, " " + this.stateText);
    if (this.reconnect) {
      const b = el("button", { class: "forkd-btn forkd-reconnect", type: "button" }, line, "Reconnect");
      b.addEventListener("click", () => this.reconnect());
    }
  }

  _drawRows(tree, rs) {
    const focused = this.list.contains(document.activeElement) ? document.activeElement.dataset.key : null;
    this.edges.textContent = "";
    const H = ROW - 6;
    this.list.querySelector(".forkd-empty")?.remove();
    const fresh = rs.map((r, i) => {
      const key = r.type === "node" ? r.id : r.key;
      const row = el("div", { class: "forkd-row", role: "treeitem", "aria-level": r.depth + 1, tabindex: "-1", "data-key": key });
      if (r.up >= 0) {
        const up = rs[r.up];
        // the guide runs midway between the parent's left edge and the child's (a step is 16 px, 8 when deep)
        const x = (indentOf(up.depth) + indentOf(r.depth)) / 2 + 1, y0 = r.up * ROW + H, y = i * ROW + H / 2;
        svgEl("path", { d: `M${x},${y0} V${y} H${indentOf(r.depth)}`, class: "forkd-edge" }, this.edges);
      }
      if (r.type === "group") this._groupRow(row, r, tree);
      else this._nodeRow(row, r.id, tree[r.id]);
      row.addEventListener("focus", () => this._roving(row));
      return signed(row);
    });
    const shown = reconcile(this.list, fresh, (c) => c.dataset.key, this.held);
    // where a row sits is not part of its drawing: a row added above moves it, and keeps it
    shown.forEach((row, i) => { row.style.top = `${i * ROW}px`; row.style.left = `${indentOf(rs[i].depth)}px`; });
    const height = rs.length * ROW;
    const deepest = Math.max(0, ...rs.map((r) => indentOf(r.depth)));
    this.list.style.height = `${height}px`;
    // every row is at least ROW_MIN wide: deeper than a narrow pane allows, the tree scrolls sideways, never
    // clips (set on the canvas's child, so the scroll ends past the canvas's padding, the rows' edges in view)
    this.content.style.minWidth = `${deepest + ROW_MIN}px`;
    this.edges.setAttribute("height", String(height));
    this.edges.setAttribute("width", String(deepest + 20));
    const target = shown.find((c) => c.dataset.key === (focused || this.selected)) || shown[0];
    for (const c of shown) c.tabIndex = c === target ? 0 : -1;
    if (target && focused && document.activeElement !== target) target.focus({ preventScroll: true });
  }

  _nodeRow(row, id, node) {
    const gone = isGone(node);
    row.classList.add("forkd-node", node.kind, `status-${node.status}`);
    if (gone) row.classList.add("forkd-gone");
    if (node.ghost) row.classList.add("forkd-ghost");
    if (node.unanswered) row.classList.add("forkd-unanswered");
    if (id === this.selected) row.classList.add("selected");
    row.dataset.id = id;
    row.dataset.status = node.status;
    row.setAttribute("aria-selected", id === this.selected ? "true" : "false");
    const warns = warningsOf(node);
    const tier = node.kind === "sandbox" && node.tier && node.tier !== "running" && !gone ? node.tier : null;
    const onHosts = this.hosts.length > 1 && !node.ghost;
    const where = onHosts && node.host ? `, on ${node.hosts && node.hosts.length > 1 ? plural(node.hosts.length, "host") : hostLabel(node.host)}` : "";
    row.setAttribute("aria-label", `${node.kind} ${id}, ${node.status}${tier ? `, ${tier}` : ""}${where}${node.unanswered ? ", as last seen" : ""}${warns.length ? `, ${plural(warns.length, "warning")}` : ""}`);
    const top = el("div", { class: "forkd-line1" }, row);
    el("span", { class: "forkd-icon", "aria-hidden": "true" }, top, node.kind === "snapshot" ? "◆" : "●");
    idLabel(top, id);
    if (!gone && node.heads && node.heads.length) el("span", { class: "forkd-chip forkd-head-chip", title: `HEAD of ${node.heads.join(", ")}` }, top, "HEAD");
    if (tier) el("span", { class: `forkd-chip forkd-tier tier-${tier}`, title: TIER_TITLES[tier] || tier }, top, tier);
    if (node.kind === "snapshot" && node.stored && !gone) {
      el("span", { class: "forkd-chip forkd-stored", title: `kept in the ${node.stored.remote ? "local and the remote" : "local"} store: ${node.stored.digest}` },
        top, node.stored.remote ? "stored · remote" : "stored");
    }
    if (warns.length) el("span", { class: "forkd-chip forkd-warn", title: warns.join("\n") }, top, `⚠ ${warns.length}`);
    const meta = el("div", { class: "forkd-line2" }, row);
    el("span", { class: `forkd-dot status-${node.status}`, "aria-hidden": "true" }, meta);
    const hist = node.history && node.history.length > 1 ? node.history.join(" → ") : node.status;
    el("span", { class: "forkd-badge" }, meta, hist);
    const chip = onHosts ? hostChip(meta, node) : null; // on the second line: the id keeps the first line's room
    if (chip && node.unanswered) chip.title += ` (${node.unanswered})`;
    const bits = [];
    if (node.ghost) bits.push("gone; kept for lineage");
    if (node.unanswered) bits.push("as last seen");
    if (node.pause_ms !== null && node.pause_ms !== undefined) bits.push(`paused ${fmtMs(node.pause_ms)}`);
    if (node.memory && node.memory.uss_kib !== undefined && !gone) bits.push(`${fmtKib(node.memory.uss_kib)} private`);
    if (node.busy !== undefined && !gone && !tier) bits.push(node.busy ? "busy" : "idle");
    if (node.engine) bits.push(node.engine);
    if (node.created !== undefined && node.created !== null && !node.ghost) {
      el("span", { class: "forkd-age", "data-created": node.created, "data-lead": "· ", title: "age" }, meta); // _tick fills it
    }
    el("span", { class: "forkd-meta" }, meta, (bits.length ? "· " + bits.join(" · ") : ""));
    row.addEventListener("click", () => this.select(this.selected === id ? null : id));
  }

  _groupRow(row, r, tree) {
    row.classList.add("forkd-group", r.kind, `status-${r.status}`);
    row.setAttribute("aria-expanded", r.open ? "true" : "false");
    row.dataset.group = r.key;
    row.dataset.count = String(r.ids.length);
    row.dataset.status = r.status;
    const noun = r.kind === "snapshot" ? "snapshots" : "sandboxes";
    row.setAttribute("aria-label", `${r.ids.length} ${noun}, ${r.status}; ${r.open ? "expanded" : "collapsed"}`);
    const top = el("div", { class: "forkd-line1" }, row);
    el("span", { class: "forkd-icon", "aria-hidden": "true" }, top, r.open ? "▾" : "▸");
    el("span", { class: "forkd-id" }, top, `${r.ids.length} × ${r.status}`);
    const meta = el("div", { class: "forkd-line2" }, row);
    el("span", { class: `forkd-dot status-${r.status}`, "aria-hidden": "true" }, meta);
    let kib = 0, known = 0;
    for (const id of r.ids) { const m = tree[id].memory; if (m && m.uss_kib !== undefined) { kib += m.uss_kib; known++; } }
    const on = this.hosts.length > 1 ? [...new Set(r.ids.map((id) => tree[id].host).filter(Boolean))] : [];
    const where = on.length > 1 ? ` · on ${on.length} hosts` : on.length ? ` · on ${hostLabel(on[0])}` : "";
    el("span", { class: "forkd-meta", title: on.length > 1 ? on.map(hostLabel).join(", ") : undefined }, meta,
      `${noun}${where}${known && !isGone(tree[r.ids[0]]) ? ` · ${fmtKib(kib)} private` : ""} · ${r.open ? "fold" : "list them"}`);
    row.addEventListener("click", () => this._toggle(r.key));
  }

  _toggle(key, open) {
    if (open === undefined) open = !this.expanded.has(key);
    if (open) this.expanded.add(key);
    else this.expanded.delete(key);
    this.render();
    const row = [...this.list.children].find((c) => c.dataset.key === key);
    if (row) row.focus();
  }

  _roving(row) {
    for (const c of this.list.children) if (c !== row) c.tabIndex = -1;
    row.tabIndex = 0;
  }

  _key(e) {
    const rowsEls = [...this.list.querySelectorAll(".forkd-row")];
    const i = rowsEls.indexOf(document.activeElement);
    if (i < 0) return;
    const row = rowsEls[i];
    const r = this.shownRows[i];
    const go = (j) => { const t = rowsEls[Math.max(0, Math.min(rowsEls.length - 1, j))]; t.focus(); t.scrollIntoView({ block: "nearest" }); };
    const keys = {
      ArrowDown: () => go(i + 1), ArrowUp: () => go(i - 1), Home: () => go(0), End: () => go(rowsEls.length - 1),
      ArrowRight: () => (r.type === "group" && !r.open ? this._toggle(r.key, true) : go(i + 1)),
      ArrowLeft: () => (r.type === "group" && r.open ? this._toggle(r.key, false) : r.up >= 0 && go(r.up)),
      Enter: () => row.click(), " ": () => row.click(),
      "+": () => this.setZoom(this.zoom * 1.25), "-": () => this.setZoom(this.zoom / 1.25), "0": () => this.fit(),
    };
    if (keys[e.key]) { e.preventDefault(); keys[e.key](); }
  }

  // What a pointer pressed is not redrawn until it is released (reconcile): a row whose sandbox came
  // up, froze or got its memory figure between the press and the release is still clicked.
  _holdStill() {
    const release = () => {
      const owed = this.held.stale;
      this.held = { el: null, stale: false };
      if (owed) setTimeout(() => this.render(), 0); // after the click this release makes
    };
    this.root.addEventListener("pointerdown", (e) => { this.held = { el: e.target, stale: false }; }, true);
    for (const type of ["pointerup", "pointercancel"]) this.root.addEventListener(type, release, true);
    this.root.addEventListener("pointerleave", release);
  }

  // drag the background to pan (scrolls the canvas)
  _pan() {
    let from = null;
    this.canvas.addEventListener("pointerdown", (e) => {
      if (e.target.closest(".forkd-row") || e.button !== 0) return;
      from = { x: e.clientX, y: e.clientY, l: this.canvas.scrollLeft, t: this.canvas.scrollTop };
      this.canvas.setPointerCapture(e.pointerId);
      this.canvas.classList.add("forkd-panning");
    });
    this.canvas.addEventListener("pointermove", (e) => {
      if (!from) return;
      this.canvas.scrollLeft = from.l - (e.clientX - from.x);
      this.canvas.scrollTop = from.t - (e.clientY - from.y);
    });
    const end = () => { from = null; this.canvas.classList.remove("forkd-panning"); };
    this.canvas.addEventListener("pointerup", end);
    this.canvas.addEventListener("pointercancel", end);
  }

  // ages change every second: drawn here, not in a row's or the details' drawing (which a redraw keeps when unchanged)
  _tick() {
    const now = Date.now() / 1000;
    for (const t of this.root.querySelectorAll(".forkd-age")) t.textContent = (t.dataset.lead || "") + age(Number(t.dataset.created), now);
  }

  // The pane is drawn afresh on every render, and each of its parts (title, facts, actions) replaces
  // the one shown only when it differs: the controls the user is on stay, their value and focus too.
  _drawDetails(tree) {
    const d = this.details;
    const focused = d.contains(document.activeElement) ? document.activeElement.dataset.keep : null;
    const fresh = el("div");
    this._details(fresh, tree);
    const parts = [...fresh.children].map((c, i) => { c.dataset.part = `${i}`; return signed(c); });
    reconcile(d, parts, (c) => c.dataset.part, this.held);
    if (focused && !d.contains(document.activeElement)) d.querySelector(`[data-keep="${focused}"]`)?.focus();
  }

  _details(d, tree) {
    const node = this.selected && tree[this.selected];
    if (!node) {
      el("div", { class: "forkd-hint" }, d, "Select a snapshot or sandbox (click, or arrows and Enter) for its details and actions.");
      return;
    }
    const id = this.selected;
    const info = node.info || {};
    el("div", { class: "forkd-details-title" }, d, `${node.ghost ? "gone " : ""}${node.kind} ${id}`);
    const table = el("table", {}, d);
    const rowsT = [["status", (node.history || [node.status]).join(" → ")], ["parent", node.parent || "—"]];
    if (node.ghost) rowsT.push(["note", "no longer exists; drawn so the lineage below it stays connected"]);
    if (node.unanswered) rowsT.push(["note", `drawn as last seen; its host did not answer (${node.unanswered})`]);
    if (node.created) {
      rowsT.push(["age", (td) => {
        el("span", { class: "forkd-age", "data-created": node.created }, td); // _tick fills it
        td.append(` (${new Date(node.created * 1000).toLocaleString()})`);
      }]);
    }
    if (node.engine) rowsT.push(["engine", node.engine]);
    if (node.hosts && node.hosts.length > 1) rowsT.push(["hosts", node.hosts.join(", ")]);
    else if (node.host) rowsT.push(["host", node.host]);
    if (node.pause_ms !== null && node.pause_ms !== undefined) rowsT.push(["pause", fmtMs(node.pause_ms)]);
    const live = !isGone(node); // a tombstone's memory, activity and tier were those of a sandbox that ended
    if (node.memory && live) rowsT.push(["memory", ["uss", "pss", "rss"].filter((k) => node.memory[`${k}_kib`] !== undefined).map((k) => `${k === "uss" ? "private" : k} ${fmtKib(node.memory[`${k}_kib`])}`).join(" · ")]);
    if (node.busy !== undefined && live && !(node.tier && node.tier !== "running")) rowsT.push(["activity", node.busy ? `busy${typeof node.busy === "string" ? `: ${node.busy}` : ""}` : "idle"]);
    if (node.kind === "sandbox" && node.tier && live) rowsT.push(["tier", `${node.tier}${TIER_TITLES[node.tier] ? ` (${TIER_TITLES[node.tier]})` : ""}`]);
    if (node.stored) rowsT.push(["stored", `${node.stored.digest} (${node.stored.remote ? "local and remote store" : "local store"})`]);
    if (node.heads && node.heads.length) rowsT.push(["HEAD of", node.heads.join(", ")]);
    for (const [k, v] of Object.entries(node.labels || {})) rowsT.push([`label ${k}`, v]);
    for (const key of ["branched_from", "pid", "branch_count", "memory_limit_mib", "prepare_ms"]) {
      if (info[key] !== undefined && info[key] !== null) rowsT.push([key, String(info[key])]);
    }
    if (node.lineage) rowsT.push(["lineage", node.lineage.join(" / ")]);
    for (const w of warningsOf(node)) rowsT.push(["⚠ warning", w]);
    for (const [k, v] of rowsT) {
      const tr = el("tr", {}, table);
      el("th", {}, tr, k);
      if (typeof v === "function") v(el("td", {}, tr));
      else el("td", {}, tr, v);
    }
    this._actions(d, id, node);
  }

  // Handlers look the tree up when clicked: a redraw may keep these buttons across many updates.
  _actions(d, id, node) {
    const bar = el("div", { class: "forkd-actions" }, d);
    const off = this.state !== "live";
    const why = off ? "not connected" : "";
    const button = (label, action, title, run, danger) => {
      const b = el("button", { class: `forkd-btn forkd-${action}${danger ? " forkd-danger" : ""}`, "data-action": action, type: "button", title: why || title }, bar, label);
      b.disabled = off || this.busy;
      b.addEventListener("click", () => this._run(action, id, run));
      return b;
    };
    const gone = isGone(node);
    // a redraw (every live update makes one) keeps what the user set here: else a click right after
    // it would fork one sandbox, or branch live, where the user had asked for another count or mode
    if (this.choice.id !== id) this.choice = { id };
    const choice = this.choice;
    if (!gone && node.kind === "sandbox") {
      const mode = el("select", { class: "forkd-mode", "data-keep": "mode", "aria-label": "branch mode", title: "live: pause ~ms, copy while it runs; diff: only changed pages; full: copy all memory in the pause" }, bar);
      for (const m of MODES) el("option", { value: m }, mode, m);
      if (choice.mode) mode.value = choice.mode;
      mode.addEventListener("change", () => { choice.mode = mode.value; });
      button("Branch", "branch", "Turn this sandbox into a new snapshot (it keeps running)", () => this.opts.act("branch", id, { mode: mode.value }));
      button("Kill", "kill", "Stop this sandbox", async () => {
        const c = await this._confirm(describeKill(this.shownTree(), id));
        return c.ok ? this.opts.act("kill", id, {}) : null;
      }, true);
    } else if (!gone) {
      const n = el("input", { type: "number", min: 1, max: 100, class: "forkd-n", "data-keep": "n", title: "how many sandboxes", "aria-label": "how many sandboxes" }, bar);
      n.value = choice.n ?? 1; // the property, not the attribute: typing does not make the drawing differ
      n.addEventListener("input", () => { choice.n = n.value; });
      const writing = node.status === "writing";
      const f = button("Fork", "fork", "Start sandboxes from this snapshot", () => {
        const count = Number(n.value); // "" when the field holds no number
        if (!Number.isInteger(count) || count < 1 || count > Number(n.max)) { // never a count other than the one asked
          throw new Error(`how many sandboxes? a whole number from 1 to ${n.max}, not ${n.value || "nothing"}`);
        }
        return this.opts.act("fork", id, { n: count });
      });
      if (node.status !== "ready") { f.disabled = true; f.title = `the snapshot is ${node.status}`; }
      const del = button("Delete", "delete", "Delete this snapshot", async () => {
        const c = await this._confirm(describeDelete(this.shownTree(), id));
        return c.ok ? this.opts.act("delete", id, { cascade: !!c.option }) : null;
      }, true);
      if (writing) { del.disabled = true; del.title = "being written: wait until it is ready or failed"; }
    }
    const copy = el("button", { class: "forkd-btn forkd-copy", "data-action": "copy", type: "button", title: "Copy the id to the clipboard" }, bar, "Copy id");
    copy.addEventListener("click", async () => {
      try {
        await (this.opts.copy ? this.opts.copy(id) : navigator.clipboard.writeText(id));
        this.setMessage(`copied ${id}`);
      } catch (err) {
        this.setMessage(`could not copy: ${err.message || err}`, true);
      }
    });
    for (const x of (this.opts.extraActions ? this.opts.extraActions(id, node) : [])) {
      const b = el("button", { class: `forkd-btn forkd-${x.action}`, "data-action": x.action, type: "button", title: x.title || "" }, bar, x.label);
      b.disabled = !!x.disabled || (x.needsLive && off);
      b.addEventListener("click", () => this._run(x.action, id, x.run));
    }
  }

  async _run(action, id, run) {
    this.busy = true;
    this.setMessage(`${action} ${id}…`);
    try {
      const message = await run();
      if (message !== null && message !== undefined) this.setMessage(message);
      else this.setMessage("");
    } catch (err) {
      this.setMessage(`error: ${action} ${id}: ${err.message || err}`, true);
    } finally {
      this.busy = false;
      this.render();
    }
  }

  _confirm(question) {
    return this.opts.confirm ? this.opts.confirm(question) : this._inlineConfirm(question);
  }

  // the widget's confirmation: a box in the details pane (a notebook output has no dialog host)
  _inlineConfirm({ title, body, ok, option }) {
    return new Promise((resolve) => {
      const box = el("div", { class: "forkd-confirm", role: "alertdialog", "aria-label": title }, this.details);
      el("div", { class: "forkd-confirm-title" }, box, title);
      for (const line of body) el("p", {}, box, line);
      let check = null;
      if (option) {
        const lab = el("label", { class: "forkd-option" }, box);
        check = el("input", { type: "checkbox", name: option.name }, lab);
        lab.appendChild(document.createTextNode(" " + option.label));
      }
      const bar = el("div", { class: "forkd-actions" }, box);
      const done = (yes) => { box.remove(); resolve({ ok: yes, option: !!(check && check.checked) }); };
      const cancel = el("button", { class: "forkd-btn forkd-cancel", type: "button" }, bar, "Cancel");
      const go = el("button", { class: "forkd-btn forkd-danger forkd-confirm-ok", type: "button" }, bar, ok);
      cancel.addEventListener("click", () => done(false));
      go.addEventListener("click", () => done(true));
      box.addEventListener("keydown", (e) => { if (e.key === "Escape") done(false); });
      cancel.focus();
    });
  }
}
