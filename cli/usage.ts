/**
 * `sandboxd usage --tenant T [--from ISO] [--to ISO] [--by sandbox|day] [--json]`: a tenant's
 * metered usage over a window, from the same SQL as `GET /v1/usage` and the operator views
 * (`usage_lines`: `usage_rollup` and `snapshot_rollup`, migrations 0003 and 0019;
 * gateway/core/usage.ts): seconds running,
 * paused and suspended, and the API's four totals, in all, per sandbox (with how each ended) or
 * per UTC day. A table, or JSON with `--json`.
 */
import { parseArgs } from "node:util";
import { SandboxdError } from "../contracts/errors.ts";
import type { UsageGrouping, UsageLine } from "../gateway/core/usage.ts";
import { defaultDataDir } from "./config.ts";
import { runOperatorOp } from "./operator.ts";
import { OPERATOR_OPS } from "./operator-ops.ts";

export interface UsageQuery {
  tenant: string;
  from: Date;
  to: Date;
  by: UsageGrouping;
}

/**
 * The one place this command reads the gateway's database: through the running service's
 * operator socket when `up` or `gateway` runs (a PGlite directory has one opener), else
 * PostgreSQL at DATABASE_URL or the data dir's PGlite directly (cli/operator.ts).
 */
export async function readUsage(dataDir: string, q: UsageQuery): Promise<UsageLine[]> {
  return runOperatorOp(dataDir, OPERATOR_OPS, "usage.read", {
    tenant: q.tenant,
    from: q.from.toISOString(),
    to: q.to.toISOString(),
    by: q.by,
  });
}

function parseTime(v: string | undefined, name: string, def: Date): Date {
  if (v === undefined) return def;
  const d = new Date(v);
  if (Number.isNaN(d.getTime()))
    throw new SandboxdError("bad_request", `--${name} must be an ISO 8601 time, got ${v}`);
  return d;
}

export async function cmdUsage(args: string[]): Promise<number> {
  const { values } = parseArgs({
    args,
    options: {
      tenant: { type: "string" },
      from: { type: "string" },
      to: { type: "string" },
      by: { type: "string" },
      json: { type: "boolean" },
      "data-dir": { type: "string" },
    },
  });
  if (!values.tenant) throw new SandboxdError("bad_request", "usage needs --tenant NAME (or its ten_ id)");
  const now = new Date();
  const from = parseTime(values.from, "from", new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1)));
  const to = parseTime(values.to, "to", now);
  if (!(from.getTime() < to.getTime())) throw new SandboxdError("bad_request", "--from must be before --to");
  const by = values.by ?? "total";
  if (by !== "total" && by !== "sandbox" && by !== "day") {
    throw new SandboxdError("bad_request", `--by must be sandbox or day, got ${by}`);
  }
  const q: UsageQuery = { tenant: values.tenant, from, to, by };
  const lines = await readUsage(values["data-dir"] ?? defaultDataDir(), q);
  if (values.json) {
    const out = { tenant: q.tenant, from: from.toISOString(), to: to.toISOString(), by, lines };
    process.stdout.write(`${JSON.stringify(out, null, 2)}\n`);
  } else {
    process.stdout.write(`usage of ${q.tenant} from ${from.toISOString()} to ${to.toISOString()}\n`);
    process.stdout.write(usageTable(lines, by));
  }
  return 0;
}

const FIGURE_COLUMNS: [keyof UsageLine, string, (n: number) => string][] = [
  ["running_seconds", "running_s", (n) => n.toFixed(1)],
  ["paused_seconds", "paused_s", (n) => n.toFixed(1)],
  ["suspended_seconds", "suspended_s", (n) => n.toFixed(1)],
  ["cpu_core_hours", "cpu_core_h", (n) => n.toFixed(6)],
  ["ram_gb_hours", "ram_gb_h", (n) => n.toFixed(6)],
  ["disk_gb_hours", "disk_gb_h", (n) => n.toFixed(6)],
  ["snapshot_gb_months", "snap_gb_mo", (n) => n.toExponential(3)],
];

/** Aligned columns: what each line is about, then the figures. */
export function usageTable(lines: readonly UsageLine[], by: UsageGrouping): string {
  const head: string[] =
    by === "sandbox" ? ["sandbox", "kind", "state", "ended"] : by === "day" ? ["day"] : [];
  const rows = lines.map((l) => {
    const about =
      by === "sandbox"
        ? [
            l.sandbox_id ?? "",
            l.kind ?? "",
            l.state ?? "",
            l.end_reason ? `${l.end_reason}${l.end_detail ? `: ${l.end_detail}` : ""}` : "",
          ]
        : by === "day"
          ? [l.day ?? ""]
          : [];
    return [...about, ...FIGURE_COLUMNS.map(([k, , f]) => f(Number(l[k] ?? 0)))];
  });
  const header = [...head, ...FIGURE_COLUMNS.map(([, h]) => h)];
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => r[i]!.length)));
  const fmt = (cells: string[]) =>
    cells
      .map((c, i) => (i < head.length ? c.padEnd(widths[i]!) : c.padStart(widths[i]!)))
      .join("  ")
      .trimEnd();
  return `${[fmt(header), ...rows.map(fmt)].join("\n")}\n`;
}
