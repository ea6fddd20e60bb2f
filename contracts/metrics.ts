/**
 * Operator metrics in the Prometheus text format (docs/operations.md "Metrics"), one registry per
 * process. Counters and histograms are kept as they happen; gauges are read at scrape time from
 * what the process already knows (`gauge(name, help, read)`). Label values are escaped as the
 * format says; label sets are bounded by their writers (a route pattern, never a path with ids).
 */

import { createHash, timingSafeEqual } from "node:crypto";

type Labels = Record<string, string>;

/** Compares without leaking where they differ (hashes: equal lengths for timingSafeEqual). */
function sameSecret(a: string, b: string): boolean {
  const h = (s: string) => createHash("sha256").update(s).digest();
  return timingSafeEqual(h(a), h(b));
}

/** Request and call durations, seconds: 5 ms to 2 min (an exec may run that long). */
export const DURATION_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120];

/** Distinct label sets one metric keeps; past it new sets are folded into `other`. */
const MAX_SERIES = 2_000;

function escapeValue(v: string): string {
  return v.replaceAll("\\", "\\\\").replaceAll("\n", "\\n").replaceAll('"', '\\"');
}

function labelText(labels: Labels): string {
  const parts = Object.entries(labels).map(([k, v]) => `${k}="${escapeValue(v)}"`);
  return parts.length ? `{${parts.join(",")}}` : "";
}

interface Counter {
  kind: "counter";
  help: string;
  series: Map<string, { labels: Labels; value: number }>;
}

interface Histogram {
  kind: "histogram";
  help: string;
  buckets: number[];
  series: Map<string, { labels: Labels; counts: number[]; sum: number; count: number }>;
}

interface Gauge {
  kind: "gauge";
  /** The TYPE line's word: `counter` for a count read from its owner (a total that only grows). */
  type: "gauge" | "counter";
  help: string;
  read: () => Promise<Array<{ labels: Labels; value: number }>> | Array<{ labels: Labels; value: number }>;
}

export class Metrics {
  private readonly metrics = new Map<string, Counter | Histogram | Gauge>();

  /** Adds `by` to counter `name` for `labels`. */
  inc(name: string, help: string, labels: Labels = {}, by = 1): void {
    let m = this.metrics.get(name) as Counter | undefined;
    if (!m) {
      m = { kind: "counter", help, series: new Map() };
      this.metrics.set(name, m);
    }
    const s = series(m.series, labels, (own) => ({ labels: own, value: 0 }));
    s.value += by;
  }

  /** Records `value` (seconds) in histogram `name` for `labels`. */
  observe(name: string, help: string, labels: Labels, value: number, buckets = DURATION_BUCKETS_S): void {
    let m = this.metrics.get(name) as Histogram | undefined;
    if (!m) {
      m = { kind: "histogram", help, buckets, series: new Map() };
      this.metrics.set(name, m);
    }
    const s = series(m.series, labels, (own) => ({
      labels: own,
      counts: buckets.map(() => 0),
      sum: 0,
      count: 0,
    }));
    for (let i = 0; i < buckets.length; i++) if (value <= buckets[i]!) s.counts[i]!++;
    s.sum += value;
    s.count++;
  }

  /** A gauge read at each scrape. */
  gauge(name: string, help: string, read: Gauge["read"]): void {
    this.metrics.set(name, { kind: "gauge", type: "gauge", help, read });
  }

  /** A counter kept by its owner (a `_total` that only grows), read at each scrape. */
  counterFrom(name: string, help: string, read: Gauge["read"]): void {
    this.metrics.set(name, { kind: "gauge", type: "counter", help, read });
  }

  /** The exposition text (`text/plain; version=0.0.4`). */
  async render(): Promise<string> {
    const out: string[] = [];
    for (const [name, m] of this.metrics) {
      out.push(`# HELP ${name} ${m.help}`, `# TYPE ${name} ${m.kind === "gauge" ? m.type : m.kind}`);
      if (m.kind === "counter")
        for (const s of m.series.values()) out.push(`${name}${labelText(s.labels)} ${s.value}`);
      else if (m.kind === "gauge") {
        let values: Array<{ labels: Labels; value: number }> = [];
        try {
          values = await m.read();
        } catch {
          values = []; // a gauge that cannot be read now is left out of this scrape, not an error
        }
        for (const v of values) out.push(`${name}${labelText(v.labels)} ${v.value}`);
      } else {
        for (const s of m.series.values()) {
          m.buckets.forEach((b, i) => {
            out.push(`${name}_bucket${labelText({ ...s.labels, le: String(b) })} ${s.counts[i]}`);
          });
          out.push(`${name}_bucket${labelText({ ...s.labels, le: "+Inf" })} ${s.count}`);
          out.push(`${name}_sum${labelText(s.labels)} ${s.sum}`);
          out.push(`${name}_count${labelText(s.labels)} ${s.count}`);
        }
      }
    }
    return `${out.join("\n")}\n`;
  }
}

function series<T>(map: Map<string, T>, labels: Labels, make: (labels: Labels) => T): T {
  let key = JSON.stringify(labels);
  let own = labels;
  if (!map.has(key) && map.size >= MAX_SERIES) {
    own = Object.fromEntries(Object.keys(labels).map((k) => [k, "other"]));
    key = JSON.stringify(own);
  }
  let s = map.get(key);
  if (!s) {
    s = make(own);
    map.set(key, s);
  }
  return s;
}

export const METRICS_PATH = "/metrics";

/**
 * The metrics endpoint's answer for `request`, or undefined when it is not a scrape. Served only
 * with a token set (`SANDBOXD_METRICS_TOKEN`) and shown as a bearer: the numbers name agents and
 * load, which are the operator's.
 */
export function metricsAnswer(
  request: Request,
  metrics: Metrics,
  token: string | undefined,
): Promise<Response> | undefined {
  if (request.method !== "GET" || new URL(request.url).pathname !== METRICS_PATH) return undefined;
  if (!token) return undefined;
  if (!sameSecret(request.headers.get("authorization") ?? "", `Bearer ${token}`))
    return Promise.resolve(
      new Response(JSON.stringify({ code: "unauthorized", message: "metrics need the operator's token" }), {
        status: 401,
        headers: { "content-type": "application/json" },
      }),
    );
  return metrics
    .render()
    .then((text) => new Response(text, { headers: { "content-type": "text/plain; version=0.0.4" } }));
}
