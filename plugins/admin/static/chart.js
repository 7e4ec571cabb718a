// Prefix hits over time, drawn by hand on a canvas: per `stats` poll, the share of the
// tokens queried since the previous poll that hit on device, host and storage
// (stacked). The counters are cumulative token counts; rates are computed here.

const WINDOW = 120; // samples kept (about two minutes at one poll a second)
const SERIES = [
  ["device", "#2f7bd8"],
  ["host", "#e39b25"],
  ["storage", "#8c5bd1"],
];

export function hitCounters(stats) {
  return {
    query: stats.cache.prefix_query_tokens,
    device: stats.cache.prefix_hit_tokens,
    host: stats.host ? stats.host.host_hit_tokens : 0,
    storage: stats.storage ? stats.storage.hit_tokens : 0,
  };
}

export class HitChart {
  constructor(canvas, legend) {
    this.canvas = canvas;
    this.legend = legend;
    this.last = null;
    this.samples = []; // {query, device, host, storage} deltas per interval
  }

  push(stats) {
    const now = hitCounters(stats);
    if (this.last !== null) {
      const delta = {};
      for (const k of Object.keys(now)) delta[k] = Math.max(now[k] - this.last[k], 0);
      this.samples.push(delta);
      if (this.samples.length > WINDOW) this.samples.shift();
    }
    this.last = now;
    this.canvas.dataset.samples = String(this.samples.length);
    this.draw();
    this.writeLegend(now);
  }

  writeLegend(total) {
    const pct = (n) => (total.query ? `${((100 * n) / total.query).toFixed(1)}%` : "–");
    const parts = SERIES.map(([name]) => `${name} ${total[name]} (${pct(total[name])})`);
    this.legend.textContent = `since start: ${total.query} tokens queried · hits: ${parts.join(" · ")}`;
  }

  draw() {
    const c = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const w = c.clientWidth || c.width;
    const h = c.clientHeight || c.height;
    if (c.width !== Math.round(w * ratio)) { c.width = Math.round(w * ratio); c.height = Math.round(h * ratio); }
    const g = c.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, w, h);
    const pad = { l: 34, r: 6, t: 6, b: 16 };
    const pw = w - pad.l - pad.r;
    const ph = h - pad.t - pad.b;
    g.font = "10px system-ui, sans-serif";
    g.fillStyle = "#777";
    g.strokeStyle = "#ddd";
    for (const frac of [0, 0.5, 1]) {
      const y = pad.t + ph * (1 - frac);
      g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke();
      g.fillText(`${frac * 100}%`, 2, y + 3);
    }
    g.fillText(`last ${WINDOW} s`, pad.l, h - 3);
    const bw = pw / WINDOW;
    const x0 = pad.l + pw - this.samples.length * bw;
    this.samples.forEach((s, i) => {
      if (!s.query) return; // nothing queried: a gap, not a 0% hit rate
      let acc = 0;
      for (const [name, color] of SERIES) {
        const frac = Math.min(s[name] / s.query, 1 - acc);
        if (frac <= 0) continue;
        g.fillStyle = color;
        g.fillRect(x0 + i * bw, pad.t + ph * (1 - acc - frac), Math.max(bw - 1, 1), ph * frac);
        acc += frac;
      }
      g.fillStyle = "#cfd8e3"; // the missed part of an interval with queries
      g.fillRect(x0 + i * bw, pad.t, Math.max(bw - 1, 1), ph * (1 - acc));
    });
  }
}

export const CHART_SERIES = SERIES;
