// The forkd lineage widget (anywidget ESM, no imports, plain SVG).
// model.get("tree") is {id: {kind, parent, status, history, created, pause_ms, info}}.

const SVG = "http://www.w3.org/2000/svg";
const COL = 236;   // horizontal distance between generations
const ROW = 70;    // vertical distance between leaves
const W = 212;     // node box
const H = 60;
const PAD = 12;

function svg(tag, attrs, parent) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (parent) parent.appendChild(e);
  return e;
}

function html(tag, attrs, parent, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

export function age(created, now) {
  if (created === null || created === undefined) return "";
  const s = Math.max(0, Math.floor(now - created));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

// Tidy enough for lineage trees: generations left to right, leaves top to bottom,
// a parent centred on its children. Returns {id: {x, y, depth}} and the extent.
export function layout(tree) {
  const ids = Object.keys(tree).sort();
  const kids = {};
  const roots = [];
  for (const id of ids) {
    const p = tree[id].parent;
    if (p && tree[p]) (kids[p] = kids[p] || []).push(id);
    else roots.push(id);
  }
  const pos = {};
  let row = 0;
  let depthMax = 0;
  const place = (id, depth) => {
    depthMax = Math.max(depthMax, depth);
    const cs = kids[id] || [];
    let y;
    if (cs.length === 0) y = row++;
    else {
      const ys = cs.map((c) => place(c, depth + 1));
      y = (ys[0] + ys[ys.length - 1]) / 2;
    }
    pos[id] = { x: depth, y, depth };
    return y;
  };
  for (const r of roots) place(r, 0);
  return { pos, rows: Math.max(row, 1), cols: depthMax + 1 };
}

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "";
  return ms < 10 ? `${ms.toFixed(2)} ms` : `${ms.toFixed(0)} ms`;
}

function render({ model, el }) {
  let selected = null;
  const root = html("div", { class: "forkd-lineage" }, el);
  const head = html("div", { class: "forkd-head" }, root);
  const canvas = html("div", { class: "forkd-canvas" }, root);
  const details = html("div", { class: "forkd-details" }, root);
  const msg = html("div", { class: "forkd-message" }, root);

  const send = (action, id, extra) => model.send({ action, id, ...(extra || {}) });

  function drawHead(tree) {
    const nodes = Object.values(tree);
    const snaps = nodes.filter((n) => n.kind === "snapshot").length;
    const sbs = nodes.length - snaps;
    head.textContent = "";
    html("span", { class: "forkd-title" }, head, "forkd lineage");
    html("span", {}, head, ` · ${snaps} snapshot${snaps === 1 ? "" : "s"} · ${sbs} sandbox${sbs === 1 ? "" : "es"} `);
    html("span", { class: model.get("live") ? "forkd-live on" : "forkd-live" }, head,
      model.get("live") ? "● live" : "○ not live");
  }

  function drawTree(tree) {
    const { pos, rows, cols } = layout(tree);
    const now = Date.now() / 1000;
    canvas.textContent = "";
    const width = cols * COL - (COL - W) + 2 * PAD;
    const height = (rows - 1) * ROW + H + 2 * PAD;
    const s = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "forkd-svg" }, canvas);
    const at = (id) => ({ x: PAD + pos[id].x * COL, y: PAD + pos[id].y * ROW });
    for (const [id, node] of Object.entries(tree)) {
      if (!node.parent || !tree[node.parent]) continue;
      const a = at(node.parent), b = at(id);
      const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2, mx = (x1 + x2) / 2;
      svg("path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, class: "forkd-edge" }, s);
    }
    for (const [id, node] of Object.entries(tree)) {
      const { x, y } = at(id);
      const g = svg("g", {
        transform: `translate(${x},${y})`, "data-id": id, "data-status": node.status,
        class: `forkd-node ${node.kind} status-${node.status}${id === selected ? " selected" : ""}`,
      }, s);
      svg("rect", { width: W, height: H, rx: node.kind === "snapshot" ? 4 : 14, class: "forkd-box" }, g);
      const title = svg("text", { x: 10, y: 17, class: "forkd-id" }, g);
      title.textContent = (node.kind === "snapshot" ? "◆ " : "● ") + (id.length > 27 ? id.slice(0, 26) + "…" : id);
      const hist = node.history && node.history.length > 1 ? node.history.join(" → ") : node.status;
      const bw = 8 + hist.length * 6.4;
      svg("rect", { x: 8, y: 23, width: bw, height: 15, rx: 7, class: `forkd-badge status-${node.status}` }, g);
      const bt = svg("text", { x: 8 + bw / 2, y: 34, "text-anchor": "middle", class: "forkd-badge-text" }, g);
      bt.textContent = hist;
      const meta = svg("text", { x: 10, y: 52, class: "forkd-meta" }, g);
      const pause = node.pause_ms !== null && node.pause_ms !== undefined ? `paused ${fmtMs(node.pause_ms)} · ` : "";
      // age: how long ago it was made (ticks every second, see the timer below)
      meta.textContent = pause + age(node.created, now) + " old";
      meta.setAttribute("data-created", node.created ?? "");
      meta.setAttribute("data-pause", pause);
      g.addEventListener("click", () => {
        selected = selected === id ? null : id;
        redraw();
      });
    }
  }

  function drawDetails(tree) {
    details.textContent = "";
    if (!selected || !tree[selected]) {
      html("div", { class: "forkd-hint" }, details, "Click a snapshot or sandbox for details and actions.");
      return;
    }
    const node = tree[selected];
    const info = node.info || {};
    const now = Date.now() / 1000;
    html("div", { class: "forkd-details-title" }, details, `${node.kind} ${selected}`);
    const table = html("table", {}, details);
    const rows = [
      ["status", (node.history || [node.status]).join(" → ")],
      ["parent", node.parent || "—"],
      ["age", age(node.created, now)],
      ["created", node.created ? new Date(node.created * 1000).toLocaleString() : ""],
    ];
    if (node.pause_ms !== null && node.pause_ms !== undefined) rows.push(["pause", fmtMs(node.pause_ms)]);
    for (const key of ["engine", "branched_from", "snapshot_tag", "pid", "branch_count", "memory_limit_mib",
      "prepare_ms", "warning"]) {
      if (info[key] !== undefined && info[key] !== null) rows.push([key, String(info[key])]);
    }
    if (info.lineage) rows.push(["lineage", info.lineage.join(" / ")]);
    for (const [k, v] of rows) {
      const tr = html("tr", {}, table);
      html("th", {}, tr, k);
      html("td", {}, tr, v);
    }
    const bar = html("div", { class: "forkd-actions" }, details);
    const button = (label, action, extra) => {
      const b = html("button", { class: `forkd-btn forkd-${action}`, "data-action": action }, bar, label);
      b.addEventListener("click", () => {
        msg.textContent = `${action} ${selected}…`;
        send(action, selected, extra ? extra() : {});
      });
      return b;
    };
    if (node.kind === "sandbox") {
      button("Branch", "branch");
      button("Kill", "kill");
    } else {
      const n = html("input", { type: "number", min: 1, max: 100, value: 1, class: "forkd-n", title: "how many" }, bar);
      button("Fork", "fork", () => ({ n: Math.max(1, parseInt(n.value, 10) || 1) }));
      button("Delete", "delete");
    }
  }

  function redraw() {
    const tree = model.get("tree") || {};
    drawHead(tree);
    drawTree(tree);
    drawDetails(tree);
    msg.textContent = model.get("message") || "";
  }

  // ages tick without a round trip to the kernel
  const timer = setInterval(() => {
    const now = Date.now() / 1000;
    for (const t of canvas.querySelectorAll("text.forkd-meta")) {
      const c = t.getAttribute("data-created");
      if (c) t.textContent = t.getAttribute("data-pause") + age(Number(c), now) + " old";
    }
  }, 1000);

  model.on("change:tree", redraw);
  model.on("change:live", redraw);
  model.on("change:message", () => { msg.textContent = model.get("message") || ""; });
  redraw();
  return () => {
    clearInterval(timer);
    model.off("change:tree", redraw);
    model.off("change:live", redraw);
  };
}

export default { render };
