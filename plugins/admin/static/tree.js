// The radix tree from a (summarized) snapshot: every node as an indented table row
// when the whole tree came, else an aggregate (counts by tier, the top nodes by hits).
// Only textContent is ever set from server data: namespaces are client strings.

export const TOP_ROWS = 200; // nodes listed in the aggregate
const COLUMNS = ["node", "tokens", "pages dev/host", "tier", "locks", "state slot", "hits", "age (ticks)"];

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

// Tier badges: device and/or host, plus storage when its pages are stored.
export function tierBadges(node) {
  const span = el("span", { class: "badges" });
  const parts = node.tier === "device+host" ? ["device", "host"] : [node.tier];
  if (node.stored) parts.push("storage");
  for (const part of parts) span.append(el("span", { class: `badge ${part}` }, part));
  return span;
}

// Root first, each node followed by its subtree; depth per node.
export function treeOrder(nodes) {
  const children = new Map();
  for (const node of nodes.slice(1)) {
    if (!children.has(node.parent)) children.set(node.parent, []);
    children.get(node.parent).push(node);
  }
  const out = [];
  const stack = nodes.length ? [[nodes[0], 0]] : [];
  while (stack.length) {
    const [node, depth] = stack.pop();
    out.push([node, depth]);
    const kids = children.get(node.id) || [];
    for (let i = kids.length - 1; i >= 0; i--) stack.push([kids[i], depth + 1]);
  }
  return out;
}

function row(node, depth, clock) {
  const isRoot = node.parent === null;
  const tr = el("tr", {
    "data-node-id": String(node.id), "data-parent": String(node.parent ?? ""), "data-tier": node.tier,
    "data-stored": String(node.stored), "data-lock": String(node.lock_ref),
  });
  const name = el("td", { class: "name" }, isRoot ? "root" : `#${node.id}`);
  name.style.paddingLeft = `${0.4 + depth * 0.9}em`;
  if (node.namespace) name.append(el("span", { class: "ns" }, ` ${node.namespace}`));
  const state = node.state_slot === null ? "–" : `${node.state_slot} @${node.state_len ?? "?"}`;
  const cells = [
    name,
    el("td", { class: "num" }, String(node.num_tokens)),
    el("td", { class: "num" }, `${node.num_pages}/${node.num_host_pages ?? 0}`),
    el("td"),
    el("td", { class: node.lock_ref > 0 ? "num locked" : "num" }, String(node.lock_ref)),
    el("td", { class: "num" }, state),
    el("td", { class: "num" }, String(node.hit_count)),
    el("td", { class: "num" }, isRoot ? "" : String(clock - node.last_access)),
  ];
  if (!isRoot) cells[3].append(tierBadges(node));
  tr.append(...cells);
  return tr;
}

function table(rows) {
  const tbl = el("table", { class: "nodes" });
  const head = el("tr");
  for (const title of COLUMNS) head.append(el("th", {}, title));
  tbl.append(el("thead"), el("tbody"));
  tbl.tHead.append(head);
  tbl.tBodies[0].append(...rows);
  return tbl;
}

export function summaryText(summary, total) {
  const t = summary.tiers;
  const fmt = (name, b) => `${name} ${b.nodes} (${b.tokens} tok)`;
  return `${total} nodes · ${fmt("device", t.device)} · ${fmt("device+host", t["device+host"])} · `
    + `${fmt("host", t.host)} · ${fmt("stored", summary.stored)} · locked ${summary.locked}`
    + (summary.with_state ? ` · with state ${summary.with_state}` : "");
}

function aggregate(snap) {
  const box = el("div", { class: "aggregate", "data-mode": "aggregate" });
  const s = snap.summary;
  const cards = el("div", { class: "tier-cards" });
  const buckets = [["device", s.tiers.device], ["device+host", s.tiers["device+host"]],
    ["host", s.tiers.host], ["storage", s.stored]];
  for (const [name, b] of buckets) {
    const card = el("div", { class: `tier-card ${name.replace("+", "-")}`, "data-tier": name });
    card.append(el("strong", {}, String(b.nodes)), el("span", {}, ` ${name} nodes · ${b.tokens} tokens`));
    cards.append(card);
  }
  const rank = snap.by === "tokens" ? (a, b) => b.num_tokens - a.num_tokens || b.hit_count - a.hit_count
    : (a, b) => b.hit_count - a.hit_count || b.num_tokens - a.num_tokens;
  const others = snap.nodes.slice(1).sort(rank).slice(0, TOP_ROWS);
  const clock = Math.max(0, ...snap.nodes.map((n) => n.last_access));
  box.append(
    el("p", { class: "hint" }, `${snap.total_nodes} nodes: too many to list; the top ${others.length} by ${snap.by}:`),
    cards, table(others.map((n) => row(n, 0, clock))),
  );
  return box;
}

// Replaces `container`'s content with the snapshot `snap` (a reply to
// {"type": "snapshot", "limit": N}); returns the summary line.
export function renderTree(container, snap) {
  let view;
  if (snap.truncated) {
    view = aggregate(snap);
  } else {
    let clock = 0;
    for (const n of snap.nodes) if (n.last_access > clock) clock = n.last_access;
    view = table(treeOrder(snap.nodes).map(([n, depth]) => row(n, depth, clock)));
    view.dataset.mode = "full";
  }
  container.replaceChildren(view);
  return snap.summary ? summaryText(snap.summary, snap.total_nodes) : `${snap.nodes.length} nodes`;
}
