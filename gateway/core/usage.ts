/**
 * Usage over a window (docs/sandboxes.md "Rules of the sandboxes API"), computed in SQL by `usage_rollup` (migrations/0003_usage_truth.sql,
 * the one place the formulas live): each usage interval contributes its overlap with [from, to)
 * (an open interval runs until `now`), weighted by its size.
 *   cpu_core_hours      = sum(vcpus * hours)               over running intervals
 *   ram_gb_hours        = sum(mem_mib / 1024 * hours)      over running and paused intervals
 *   disk_gb_hours       = sum(disk_bytes / 2^30 * hours)   over running and paused intervals
 *   snapshot_gb_months  = sum(disk_bytes / 2^30 * hours / 730) over suspended intervals
 *                       + sum(size_bytes / 2^30 * hours / 730) over kept snapshots
 *                         (`snapshot_rollup`, migrations/0019_usage_views_with_snapshots.sql)
 * GB means GiB (2^30 bytes); a month is 730 hours (8760 / 12). See docs/quotas-and-usage.md "Usage metering".
 * Both are read through `usage_lines` (the same migration); the operator views (`usage_by_tenant`,
 * `usage_by_tenant_day`, `usage_by_sandbox`) are it over all time; `usageReport` is what
 * `sandboxd usage` prints.
 */
import { eq, type SQL, sql } from "drizzle-orm";
import type { Db } from "../../db/client.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { snapshots } from "../../db/schema/snapshots.ts";
import { tenants } from "../../db/schema/tenants.ts";

export interface UsageTotals {
  cpu_core_hours: number;
  ram_gb_hours: number;
  disk_gb_hours: number;
  snapshot_gb_months: number;
}

/** The seconds per metering state beside the totals. */
export interface UsageFigures extends UsageTotals {
  running_seconds: number;
  paused_seconds: number;
  suspended_seconds: number;
}

const FIGURES = [
  "running_seconds",
  "paused_seconds",
  "suspended_seconds",
  "cpu_core_hours",
  "ram_gb_hours",
  "disk_gb_hours",
  "snapshot_gb_months",
] as const satisfies readonly (keyof UsageFigures)[];

/**
 * Every metered line of one tenant over the window, as a FROM item named `r`: `usage_lines`
 * (migration 0019), the sandboxes' intervals (`usage_rollup`) and the kept snapshots'
 * (`snapshot_rollup`: one interval per snapshot from `ready_at` to `deleted_at`, weighted by
 * `size_bytes`; its `sandbox_id` holds the snapshot's id).
 */
function rollup(tenantId: string, from: Date, to: Date, now: Date): SQL {
  return sql`usage_lines(${tenantId}, ${from.toISOString()}::timestamptz, ${to.toISOString()}::timestamptz, ${now.toISOString()}::timestamptz) r`;
}

/** Each figure summed over the rows of `r` (as text: both drivers read float8 sums alike). */
function sums(): Record<(typeof FIGURES)[number], SQL<string>> {
  return Object.fromEntries(
    FIGURES.map((f) => [f, sql<string>`coalesce(sum(${sql.raw(`r.${f}`)}), 0)::text`]),
  ) as Record<(typeof FIGURES)[number], SQL<string>>;
}

function figures(row: Record<(typeof FIGURES)[number], string>): UsageFigures {
  return Object.fromEntries(FIGURES.map((f) => [f, Number(row[f])])) as unknown as UsageFigures;
}

export async function usageTotals(
  db: Db,
  tenantId: string,
  from: Date,
  to: Date,
  now: Date,
): Promise<UsageTotals> {
  const [row] = await db.select(sums()).from(rollup(tenantId, from, to, now));
  const f = figures(row!);
  return {
    cpu_core_hours: f.cpu_core_hours,
    ram_gb_hours: f.ram_gb_hours,
    disk_gb_hours: f.disk_gb_hours,
    snapshot_gb_months: f.snapshot_gb_months,
  };
}

export type UsageGrouping = "total" | "sandbox" | "day";

/** One line of a report: the figures, and what the line is about. */
export type UsageLine = UsageFigures & {
  /** `--by day`: the UTC day, YYYY-MM-DD. */
  day?: string;
  /** `--by sandbox`: the sandbox and how it ended, or a kept snapshot (kind `snapshot`). */
  sandbox_id?: string;
  kind?: string;
  state?: string;
  end_reason?: string | null;
  end_detail?: string | null;
};

/** The tenant named `tenant` (its name, as `key create --tenant` took it, or its `ten_` id). */
export async function tenantIdOf(db: Db, tenant: string): Promise<string | undefined> {
  const col = tenant.startsWith("ten_") ? tenants.id : tenants.name;
  const [row] = await db.select({ id: tenants.id }).from(tenants).where(eq(col, tenant));
  return row?.id;
}

/**
 * The usage of one tenant over [from, to), in total, per sandbox (with its state and how it
 * ended) or per UTC day, ordered by sandbox id or day.
 */
export async function usageReport(
  db: Db,
  q: { tenantId: string; from: Date; to: Date; now: Date; by: UsageGrouping },
): Promise<UsageLine[]> {
  const src = rollup(q.tenantId, q.from, q.to, q.now);
  if (q.by === "total") {
    const rows = await db.select(sums()).from(src);
    return rows.map(figures);
  }
  if (q.by === "day") {
    const rows = await db
      .select({ day: sql<string>`to_char(r.day, 'YYYY-MM-DD')`, ...sums() })
      .from(src)
      .groupBy(sql`r.day`)
      .orderBy(sql`r.day`);
    return rows.map((r) => ({ day: r.day, ...figures(r) }));
  }
  // A line's `sandbox_id` names a sandbox or a kept snapshot (kind `snapshot`, its state).
  const rows = await db
    .select({
      sandbox_id: sql<string>`r.sandbox_id`,
      kind: sql<string>`coalesce(${sandboxes.kind}, 'snapshot')`,
      state: sql<string>`coalesce(${sandboxes.state}, ${snapshots.state})`,
      end_reason: sandboxes.endReason,
      end_detail: sandboxes.endDetail,
      ...sums(),
    })
    .from(src)
    .leftJoin(sandboxes, sql`${sandboxes.id} = r.sandbox_id`)
    .leftJoin(snapshots, sql`${snapshots.id} = r.sandbox_id`)
    .groupBy(sql`r.sandbox_id`, sandboxes.id, snapshots.id)
    .orderBy(sql`r.sandbox_id`);
  return rows.map(({ sandbox_id, kind, state, end_reason, end_detail, ...r }) => ({
    sandbox_id,
    kind,
    state,
    end_reason,
    end_detail,
    ...figures(r),
  }));
}
