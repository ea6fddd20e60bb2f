/**
 * The usage chart: one group of two bars per UTC day (CPU core-hours, RAM GB-hours), drawn as
 * inline SVG (no chart library). Each bar has a `<title>` with the day's four totals.
 */
import { el, svg } from "./dom.js";

/** The drawing's size and margins in SVG units (the axis labels fit in LEFT and BOTTOM). */
const WIDTH = 720;
const HEIGHT = 180;
const LEFT = 48;
const BOTTOM = 22;
const TOP = 10;

/** A value as a short string: 0, 0.0012, 1.5, 230. */
function short(v) {
  if (v === 0) return "0";
  if (v < 0.01) return v.toPrecision(2);
  if (v < 100) return v.toFixed(2).replace(/\.?0+$/, "");
  return String(Math.round(v));
}

/** `days`: `[{ day: "2026-11-23", totals: { cpu_core_hours, ram_gb_hours, ... } }]`, oldest first. */
export function usageChart(days) {
  const max = Math.max(...days.flatMap((d) => [d.totals.cpu_core_hours, d.totals.ram_gb_hours]), 0);
  const plotH = HEIGHT - BOTTOM - TOP;
  const slot = (WIDTH - LEFT) / Math.max(days.length, 1);
  const barW = Math.max(2, slot * 0.35);
  const y = (v) => (max > 0 ? (v / max) * plotH : 0);
  const root = svg("svg", {
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    width: WIDTH,
    height: HEIGHT,
    role: "img",
    "aria-label": "usage by day",
  });
  root.append(
    svg("line", { class: "axis", x1: LEFT, y1: TOP + plotH, x2: WIDTH, y2: TOP + plotH }),
    svg("line", { class: "axis", x1: LEFT, y1: TOP, x2: LEFT, y2: TOP + plotH }),
    svg("text", { x: LEFT - 4, y: TOP + 8, "text-anchor": "end" }, short(max)),
    svg("text", { x: LEFT - 4, y: TOP + plotH, "text-anchor": "end" }, "0"),
  );
  days.forEach((d, i) => {
    const x0 = LEFT + i * slot + slot * 0.12;
    const t = d.totals;
    const tip =
      `${d.day}: ${short(t.cpu_core_hours)} CPU core-h, ${short(t.ram_gb_hours)} RAM GB-h, ` +
      `${short(t.disk_gb_hours)} disk GB-h, ${short(t.snapshot_gb_months)} snapshot GB-months`;
    const bars = [
      ["bar-cpu", t.cpu_core_hours, x0],
      ["bar-ram", t.ram_gb_hours, x0 + barW + 1],
    ];
    const group = svg("g", { "data-day": d.day });
    for (const [cls, v, x] of bars) {
      // A non-zero day shows at least one pixel, so a short sandbox still shows on the chart.
      const h = v > 0 ? Math.max(1, y(v)) : 0;
      group.append(
        svg("rect", { class: cls, x, y: TOP + plotH - h, width: barW, height: h }, svg("title", {}, tip)),
      );
    }
    group.append(svg("text", { x: x0 + barW, y: HEIGHT - 6, "text-anchor": "middle" }, d.day.slice(5)));
    root.append(group);
  });
  const legend = el(
    "div",
    { class: "legend" },
    el("span", { class: "swatch cpu" }),
    "CPU core-hours",
    el("span", { class: "swatch ram" }),
    "RAM GB-hours",
  );
  const box = el("div");
  box.append(root, legend);
  return box;
}

/** The last `n` UTC days as `{ day, from, to }` (ISO), oldest first; today's ends now. */
export function lastDays(n, nowMs) {
  const today = new Date(nowMs);
  const start = Date.UTC(today.getUTCFullYear(), today.getUTCMonth(), today.getUTCDate());
  const out = [];
  for (let i = n - 1; i >= 0; i--) {
    const from = start - i * 86_400_000;
    const to = Math.min(from + 86_400_000, nowMs);
    if (to <= from) continue; // the first millisecond of a day has no window yet
    out.push({
      day: new Date(from).toISOString().slice(0, 10),
      from: new Date(from).toISOString(),
      to: new Date(to).toISOString(),
    });
  }
  return out;
}

/** Bytes as MiB with one decimal. */
export function mib(bytes) {
  return `${(bytes / 1048576).toFixed(1)} MiB`;
}

/**
 * A sandbox's live metrics (`GET /v1/sandboxes/{id}/metrics`): two lines over its samples, CPU %
 * (scaled to its own peak, at least 100) and memory used (scaled to the guest's RAM size), oldest
 * on the left. Each point has a `<title>` with the sample's figures.
 */
export function metricsChart(m) {
  const samples = m.samples;
  const plotH = HEIGHT - BOTTOM - TOP;
  const cpuMax = Math.max(100, ...samples.map((s) => s.cpu_percent ?? 0));
  const memMax = Math.max(m.memory_limit_bytes ?? 0, ...samples.map((s) => s.memory_used_bytes), 1);
  const step = (WIDTH - LEFT) / Math.max(samples.length - 1, 1);
  const x = (i) => LEFT + i * step;
  const y = (v, max) => TOP + plotH - (v / max) * plotH;
  const root = svg("svg", {
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    width: WIDTH,
    height: HEIGHT,
    role: "img",
    "aria-label": "live metrics",
  });
  root.append(
    svg("line", { class: "axis", x1: LEFT, y1: TOP + plotH, x2: WIDTH, y2: TOP + plotH }),
    svg("line", { class: "axis", x1: LEFT, y1: TOP, x2: LEFT, y2: TOP + plotH }),
    svg("text", { x: LEFT - 4, y: TOP + 8, "text-anchor": "end" }, `${Math.round(cpuMax)}%`),
    svg("text", { x: LEFT - 4, y: TOP + plotH, "text-anchor": "end" }, "0"),
    svg("text", { x: WIDTH - 2, y: TOP + 8, "text-anchor": "end" }, mib(memMax)),
  );
  const line = (cls, pick, max) => {
    const pts = samples
      .map((s, i) => [i, pick(s)])
      .filter(([, v]) => v !== null && v !== undefined)
      .map(([i, v]) => `${x(i).toFixed(1)},${y(v, max).toFixed(1)}`);
    if (pts.length > 0) root.append(svg("polyline", { class: cls, points: pts.join(" ") }));
  };
  line("line-cpu", (s) => s.cpu_percent, cpuMax);
  line("line-mem", (s) => s.memory_used_bytes, memMax);
  samples.forEach((s, i) => {
    const tip =
      `${s.at}: CPU ${s.cpu_percent ?? "–"}%, memory ${mib(s.memory_used_bytes)} ` +
      `(resident ${mib(s.memory_resident_bytes)}), disk ${mib(s.disk_used_bytes)}`;
    root.append(
      svg(
        "circle",
        { class: "point", cx: x(i), cy: y(s.cpu_percent ?? 0, cpuMax), r: 2 },
        svg("title", {}, tip),
      ),
    );
  });
  const legend = el(
    "div",
    { class: "legend" },
    el("span", { class: "swatch cpu" }),
    "CPU % of one host core",
    el("span", { class: "swatch ram" }),
    "memory used",
  );
  const box = el("div");
  box.append(root, legend);
  return box;
}
