// Pool and tier gauges from a `stats` reply: one stacked bar per pool.

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

export function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// parts: [[class, label, value, shown?]]; total: the bar's full width.
function gauge(name, title, parts, total, note) {
  const box = el("div", { class: "gauge", "data-gauge": name });
  const bar = el("div", { class: "bar" });
  for (const [cls, label, value] of parts) {
    box.dataset[label.replace(/\W+(\w)/g, (_, c) => c.toUpperCase())] = String(value);
    if (!total || !value) continue;
    const seg = el("span", { class: `seg ${cls}`, title: `${label}: ${value}` });
    seg.style.width = `${(100 * value) / total}%`;
    bar.append(seg);
  }
  const legend = parts.map(([, label, value, shown]) => `${label} ${shown ?? value}`).join(" · ");
  box.append(el("div", { class: "gauge-title" }, `${title}${note ? ` — ${note}` : ""}`), bar,
    el("div", { class: "gauge-legend" }, legend));
  return box;
}

function devicePages(p) {
  const locked = p.cached - p.evictable;
  return gauge("device", `device pages (${p.usable})`, [
    ["held", "held", p.held], ["locked", "cached locked", locked],
    ["cached", "cached evictable", p.evictable], ["free", "free", p.free],
  ], p.usable);
}

function hostPages(h) {
  const hp = h.host_pages;
  return gauge("host", `host pages (${hp.usable})`, [
    ["copying", "copying", hp.copying], ["cached", "cached", hp.cached], ["free", "free", hp.free],
  ], hp.usable, `offloaded ${h.offloaded_pages} · loaded back ${h.loaded_pages}`);
}

function storage(s) {
  const pages = s.backend_stats?.pages ?? 0;
  const bytes = s.backend_stats?.bytes ?? null;
  const max = s.max_bytes ?? null;
  const free = Math.max((max ?? 0) - (bytes ?? 0), 0);
  const used = bytes !== null && max
    ? [["stored", "used", bytes, formatBytes(bytes)], ["free", "free", free, formatBytes(free)]]
    : [["stored", "pages", pages]];
  const state = s.enabled ? "on" : "OFF";
  const note = `${s.backend} ${state} · ${pages} pages · written ${s.written_pages} · read ${s.read_pages}`
    + ` · queued ${formatBytes(s.queued_bytes)}`;
  return gauge("storage", "storage tier", used, max || pages, note);
}

function states(st) {
  return gauge("states", `state slots (${st.usable})`, [
    ["held", "held", st.held], ["cached", "cached", st.cached], ["free", "free", st.free],
  ], st.usable);
}

// Tensor parallelism: one bar per rank (its KV bytes; every rank holds its shard of the
// same pages), its process, cores and other pools in the note.
function ranks(p) {
  const c = p.collectives;
  const head = el("p", { class: "gauge-legend", "data-gauge": "collectives" },
    `tensor parallel, ${p.tp_size} ranks · all-reduced ${formatBytes(c.reduced_bytes)}`
    + ` · gathered ${formatBytes(c.gathered_bytes)} · ${c.seconds.toFixed(2)} s in collectives (rank 0)`);
  const bars = p.ranks.map((r) => {
    const kv = r.kv_bytes;
    const box = gauge(`rank-${r.rank}`, `rank ${r.rank} KV`, [
      ["held", "used", kv.used, formatBytes(kv.used)], ["free", "free", kv.total - kv.used, formatBytes(kv.total - kv.used)],
    ], kv.total, `${r.alive ? "up" : "DOWN"} · pid ${r.pid} · cores ${r.cpus.join(",")}`
      + ` · host ${formatBytes(r.host_bytes.used)} / ${formatBytes(r.host_bytes.total)}`
      + (r.state_bytes.total ? ` · states ${formatBytes(r.state_bytes.used)} / ${formatBytes(r.state_bytes.total)}` : ""));
    box.dataset.alive = String(r.alive);
    return box;
  });
  return [head, ...bars];
}

function audit(a) {
  const sum = (counts) => Object.values(counts).reduce((x, y) => x + y, 0);
  const last = a.last_mismatch;
  const note = last
    ? ` · LAST MISMATCH: ${last.rid} (${last.tier} hit) at token ${last.first_divergence}`
    : "";
  return el("p", { class: "gauge-legend", "data-gauge": "audit" },
    `audit (${a.compare}) checked ${sum(a.checked)} · mismatched ${sum(a.mismatched)}`
    + ` · pending ${a.pending} · dropped ${a.dropped}${note}`);
}

export function renderGauges(container, stats) {
  const boxes = [devicePages(stats.pages)];
  if (stats.host) boxes.push(hostPages(stats.host));
  if (stats.storage) boxes.push(storage(stats.storage));
  if (stats.states) boxes.push(states(stats.states));
  if (stats.parallel) boxes.push(...ranks(stats.parallel));
  const r = stats.requests;
  const halted = stats.halt_reason ? ` · HALTED: ${stats.halt_reason}` : "";
  boxes.push(el("p", { class: "gauge-legend", "data-gauge": "requests" },
    `requests running ${r.running} · waiting ${r.waiting} · steps ${stats.counters.steps}`
    + ` · retractions ${stats.num_retractions}${halted}`));
  if (stats.audit) boxes.push(audit(stats.audit));
  container.replaceChildren(...boxes);
}
