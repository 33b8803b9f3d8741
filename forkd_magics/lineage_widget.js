// The lineage widget's front end (anywidget): the shared drawing over the kernel's model.
// _widget.py hands anywidget one module made of lineage_tree.js, lineage.js and this file, in that
// order, without their relative imports (anywidget loads a single file).

import { LineageView } from "./lineage.js";

// The kernel owns the data (model "tree", "live", "message"); actions are custom messages answered
// by {reply: n, ok, message}. The view says "disconnected" when the comm closes (the kernel restarted
// or shut down), when the kernel stopped following the server (`live` false: a reconnect button),
// or when a request got no answer: nothing waits forever. There is no periodic ping: each message to
// the kernel shows it busy for a moment in the notebook's status.

const REPLY_TIMEOUT = 30000;

function render({ model, el: host }) {
  let seq = 0;
  const waiting = new Map();
  let commOpen = true;
  let unanswered = false;
  const ask = (content, timeout = REPLY_TIMEOUT) => new Promise((resolve, reject) => {
    const n = ++seq;
    const timer = setTimeout(() => {
      waiting.delete(n);
      unanswered = true;
      showState();
      reject(new Error("the kernel did not answer (it may be busy, or gone)"));
    }, timeout);
    waiting.set(n, { resolve, reject, timer });
    model.send({ ...content, req: n });
  });
  const view = new LineageView(host, {
    act: async (action, id, args) => {
      const r = await ask({ action, id, ...args });
      if (!r.ok) throw new Error(r.message);
      return r.message;
    },
    // "Keep this one" on a child of an open fork tree: asks first (its siblings go), then promotes
    extraActions: (id, node) => {
      const treeId = (node.labels || {}).fork_tree_id;
      if (node.kind !== "sandbox" || !treeId || node.ghost || node.tomb || node.status !== "running") return [];
      return [{
        action: "keep", label: "Keep this one", needsLive: true,
        title: `Keep ${id}, the winner of fork tree ${treeId}: its siblings are killed`,
        run: async () => {
          const tree = model.get("tree") || {};
          const siblings = Object.keys(tree).filter((k) => k !== id && (tree[k].labels || {}).fork_tree_id === treeId);
          const c = await view._confirm({
            title: `Keep ${id}?`,
            body: [`It wins fork tree ${treeId}: ${siblings.length} sibling(s) killed${siblings.length ? ` (${siblings.join(", ")})` : ""}, and the tree's snapshot released if nothing needs it.`,
                   "A sibling another notebook runs in or has checked out stays."],
            ok: "Keep this one",
          });
          if (!c.ok) return null;
          const r = await ask({ action: "keep", id });
          if (!r.ok) throw new Error(r.message);
          return r.message;
        },
      }];
    },
    // the kernel keeps killed and deleted nodes in `tree` (so a view drawn after they went, as
    // under Run All, shows them too): "clear gone" asks it to forget them
    clearGone: () => { if (commOpen) ask({ action: "clear" }).catch(() => {}); },
  });
  const onCustom = (msg) => {
    if (!msg || msg.reply === undefined) return;
    unanswered = false;
    const w = waiting.get(msg.reply);
    if (w) {
      waiting.delete(msg.reply);
      clearTimeout(w.timer);
      w.resolve(msg);
    }
    showState();
  };
  const showState = () => {
    if (!commOpen) view.setState("disconnected", "the kernel that drew this widget is gone: run the cell again.");
    else if (unanswered) view.setState("disconnected", "the kernel does not answer (busy, or gone).", () => ask({ action: "ping" }, 5000).catch(() => {}));
    else if (!model.get("live")) {
      view.setState("disconnected", model.get("message") || "not following the server.", () =>
        ask({ action: "reconnect" }).then((r) => view.setMessage(r.message, !r.ok)).catch((e) => view.setMessage(e.message, true)));
    } else view.setState("live");
  };
  const onTree = () => view.update(model.get("tree") || {});
  const onMessage = () => { const m = model.get("message") || ""; view.setMessage(m, m.startsWith("error")); };
  const onComm = () => {
    commOpen = false;
    for (const w of waiting.values()) { clearTimeout(w.timer); w.reject(new Error("the kernel is gone")); }
    waiting.clear();
    showState();
  };
  model.on("msg:custom", onCustom);
  model.on("change:tree", onTree);
  model.on("change:live", showState);
  model.on("change:message", onMessage);
  model.on("comm_live_update", onComm);
  model.on("destroy", onComm);
  onTree();
  onMessage();
  showState();
  return () => {
    for (const w of waiting.values()) clearTimeout(w.timer);
    model.off("msg:custom", onCustom);
    model.off("change:tree", onTree);
    model.off("change:live", showState);
    model.off("change:message", onMessage);
    model.off("comm_live_update", onComm);
    model.off("destroy", onComm);
    view.dispose();
  };
}

export default { render };
