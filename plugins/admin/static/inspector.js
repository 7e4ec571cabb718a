// The cache inspector: connects to /admin/ws on this origin (asking for the admin key
// when the server wants one), then polls stats every second, follows the tree
// (a summarized snapshot, refreshed at most every 500 ms after events) and lists the
// pushed events. Controls: flush, integrity check, policies, storage on/off.

import { AdminSocket, socketUrl } from "./socket.js";
import { TOP_ROWS, renderTree } from "./tree.js";
import { renderGauges } from "./gauges.js";
import { HitChart } from "./chart.js";

const KEY_ITEM = "tierserve.adminKey"; // sessionStorage: this tab only, gone when it closes
const MAX_ROWS = 2000; // a bigger tree is shown as an aggregate
const STATS_MS = 1000;
const TREE_MIN_MS = 500; // at most two snapshots a second, however many events arrive
const TREE_STALE_MS = 3000; // and one at least this often (hit counts, locks)
const MAX_EVENTS = 200;
const RETRY_MS = 2000;

const $ = (id) => document.getElementById(id);
const ui = {
  conn: $("conn"), keyForm: $("key-form"), key: $("admin-key"), keyMessage: $("key-message"), main: $("main"),
  status: $("status"), tree: $("tree"), treeSummary: $("tree-summary"), gauges: $("gauges"), events: $("events"),
  pause: $("events-pause"), tokens: $("events-tokens"),
  storageState: $("storage-state"), storageToggle: $("storage-toggle"),
  selects: { evict: $("evict-policy"), schedule: $("schedule-policy") },
};
const chart = new HitChart($("hit-chart"), $("hit-legend"));
const sock = new AdminSocket(socketUrl(window.location), { onEvent, onClose });
const view = { timers: [], treeDirty: true, treeBusy: false, treeAt: 0, bigTree: false, storageOn: null };
let pendingEvents = [];

function setConn(state, text) {
  ui.conn.dataset.state = state;
  ui.conn.textContent = text;
}

function say(text, kind = "info") {
  ui.status.dataset.kind = kind;
  ui.status.textContent = text;
}

async function start() {
  setConn("connecting", "connecting…");
  const key = sessionStorage.getItem(KEY_ITEM);
  const result = await sock.connect(key);
  if (result === "ok") {
    await onConnected();
  } else if (result === "needs_key") {
    if (key) sessionStorage.removeItem(KEY_ITEM);
    askForKey(key ? "That key was refused." : "This server needs its admin key.");
  } else {
    setConn("disconnected", "cannot open the admin socket; retrying…");
    setTimeout(start, RETRY_MS);
  }
}

function askForKey(message) {
  setConn("needs-key", "admin key needed");
  ui.main.hidden = true;
  ui.keyForm.hidden = false;
  ui.keyMessage.textContent = message;
  ui.key.focus();
}

ui.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, ui.key.value);
  ui.key.value = "";
  ui.keyForm.hidden = true;
  start();
});

async function onConnected() {
  setConn("connected", "connected");
  ui.keyForm.hidden = true;
  ui.main.hidden = false;
  try {
    await sock.request({ type: "subscribe" }); // before the first snapshot: no event is missed
    await loadPolicies();
  } catch (err) {
    say(String(err.message), "error");
  }
  view.treeDirty = true;
  view.timers = [setInterval(pollStats, STATS_MS), setInterval(maybeRefreshTree, TREE_MIN_MS / 2)];
  pollStats();
  maybeRefreshTree();
}

function onClose(event) {
  for (const timer of view.timers) clearInterval(timer);
  view.timers = [];
  setConn("disconnected", `disconnected (${event.code}${event.reason ? `: ${event.reason}` : ""}); retrying…`);
  setTimeout(start, RETRY_MS);
}

// ---- tree ---------------------------------------------------------------------------

async function maybeRefreshTree() {
  const now = performance.now();
  const due = view.treeDirty ? TREE_MIN_MS : TREE_STALE_MS;
  if (view.treeBusy || now - view.treeAt < due) return;
  view.treeBusy = true;
  view.treeDirty = false;
  view.treeAt = now;
  try {
    const snap = await sock.request({ type: "snapshot", limit: view.bigTree ? TOP_ROWS + 1 : MAX_ROWS, by: "hits" });
    view.bigTree = snap.total_nodes > MAX_ROWS;
    ui.treeSummary.textContent = renderTree(ui.tree, snap);
  } catch (err) {
    say(`snapshot: ${err.message}`, "error");
  } finally {
    view.treeBusy = false;
  }
}

// ---- stats, policies, storage ----------------------------------------------------------

async function pollStats() {
  let stats;
  try {
    stats = await sock.request({ type: "stats" });
  } catch {
    return; // a closed socket is reported by onClose
  }
  renderGauges(ui.gauges, stats);
  chart.push(stats);
  for (const [kind, select] of Object.entries(ui.selects)) {
    const current = stats.policies[kind];
    select.dataset.current = current ?? "";
    if (document.activeElement !== select && current) select.value = current;
  }
  view.storageOn = stats.storage ? stats.storage.enabled : null;
  ui.storageState.textContent = view.storageOn === null ? "none" : view.storageOn ? "on" : "off";
  ui.storageState.dataset.state = ui.storageState.textContent;
  ui.storageToggle.disabled = view.storageOn === null;
  ui.storageToggle.textContent = view.storageOn ? "Switch off" : "Switch on";
}

async function loadPolicies() {
  const reply = await sock.request({ type: "policies" });
  for (const [kind, select] of Object.entries(ui.selects)) {
    const names = reply.known[kind] || [];
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    select.disabled = reply.current[kind] === null;
    if (reply.current[kind]) select.value = reply.current[kind];
    select.dataset.current = reply.current[kind] ?? "";
  }
}

async function command(msg, describe) {
  try {
    const reply = await sock.request(msg);
    const [text, kind] = describe(reply);
    say(text, kind);
  } catch (err) {
    say(`${msg.type}: ${err.message}`, "error");
  }
  view.treeDirty = true;
  pollStats();
}

$("flush").addEventListener("click", () => command({ type: "flush" },
  (r) => (r.ok ? ["cache flushed", "ok"] : [`flush refused: ${r.reason}`, "error"])));
$("check").addEventListener("click", () => command({ type: "check" },
  (r) => (r.ok ? ["check ok", "ok"] : [`check FAILED: ${r.message}`, "error"])));
for (const kind of ["evict", "schedule"]) {
  $(`apply-${kind}`).addEventListener("click", () => command(
    { type: "set_policy", kind, name: ui.selects[kind].value },
    (r) => [`${kind === "evict" ? "eviction" : "scheduling"} policy set to ${r.name}`, "ok"],
  ));
}
ui.storageToggle.addEventListener("click", () => command({ type: "storage", enable: !view.storageOn },
  (r) => [`storage tier ${r.enabled ? "on" : "off"}`, "ok"]));

// ---- events ---------------------------------------------------------------------------

function onEvent(msg) {
  if (msg.type === "kv_event" || msg.kind === "admitted" || msg.kind === "finished") view.treeDirty = true;
  if (ui.pause.checked || (msg.kind === "tokens" && !ui.tokens.checked)) return; // one a step: noise
  if (pendingEvents.length === 0) requestAnimationFrame(flushEvents);
  pendingEvents.push(msg);
  if (pendingEvents.length > MAX_EVENTS) pendingEvents = pendingEvents.slice(-MAX_EVENTS);
}

const hex = (h) => (typeof h === "bigint" || typeof h === "number" ? h.toString(16).padStart(16, "0") : String(h));

export function describeEvent(msg) {
  if (msg.type === "request_event") {
    const extra = ["prompt_tokens", "cached_tokens", "count", "reason", "completion_tokens"]
      .filter((k) => msg[k] !== undefined).map((k) => `${k}=${msg[k]}`).join(" ");
    return [`req ${msg.kind}`, `${msg.rid} ${extra}`];
  }
  const hashes = msg.block_hashes || (msg.block_hash !== undefined ? [msg.block_hash] : []);
  const where = msg.medium ? ` [${msg.medium}]` : "";
  const first = hashes.length ? ` ${hex(hashes[0])}${hashes.length > 1 ? ` +${hashes.length - 1}` : ""}` : "";
  return [`kv ${msg.event}${where}`, hashes.length ? `${hashes.length} block(s)${first}` : ""];
}

function flushEvents() {
  const batch = pendingEvents;
  pendingEvents = [];
  const time = new Date().toLocaleTimeString();
  const items = batch.reverse().map((msg) => {
    const [head, body] = describeEvent(msg);
    const li = document.createElement("li");
    li.dataset.type = msg.type;
    li.dataset.name = msg.event || msg.kind;
    const b = document.createElement("b");
    b.textContent = head;
    li.append(`${time} `, b, ` ${body}`);
    return li;
  });
  ui.events.prepend(...items);
  while (ui.events.childElementCount > MAX_EVENTS) ui.events.lastElementChild.remove();
}

start();
