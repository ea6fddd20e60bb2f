/**
 * Usage over a window (spec 2.9), computed in SQL from usage_intervals: each interval contributes
 * its overlap with [from, to) (an open interval runs until `now`), weighted by its size.
 *   cpu_core_hours      = sum(vcpus * hours)               over running intervals
 *   ram_gb_hours        = sum(mem_mib / 1024 * hours)      over running and paused intervals
 *   disk_gb_hours       = sum(disk_bytes / 2^30 * hours)   over running and paused intervals
 *   snapshot_gb_months  = sum(disk_bytes / 2^30 * hours / 730) over suspended intervals
 * GB means GiB (2^30 bytes); a month is 730 hours (8760 / 12). See docs/decisions.md.
 */
import { and, eq, gt, isNull, lt, or, sql } from "drizzle-orm";
import type { Db } from "../../db/client.ts";
import { usageIntervals as u } from "../../db/schema/usage-intervals.ts";

export interface UsageTotals {
  cpu_core_hours: number;
  ram_gb_hours: number;
  disk_gb_hours: number;
  snapshot_gb_months: number;
}

export const HOURS_PER_MONTH = 730;

export async function usageTotals(
  db: Db,
  tenantId: string,
  from: Date,
  to: Date,
  now: Date,
): Promise<UsageTotals> {
  const f = from.toISOString();
  const t = to.toISOString();
  const n = now.toISOString();
  // Overlap in hours of [started_at, coalesce(ended_at, now)) with [from, to), never negative.
  const hours = sql`greatest(0, extract(epoch from (
      least(coalesce(${u.endedAt}, ${n}::timestamptz), ${t}::timestamptz)
      - greatest(${u.startedAt}, ${f}::timestamptz)))) / 3600.0`;
  const [row] = await db
    .select({
      cpu: sql<string>`coalesce(sum(case when ${u.state} = 'running' then ${u.vcpus} * ${hours} end), 0)`,
      ram: sql<string>`coalesce(sum(case when ${u.state} in ('running', 'paused') then ${u.memMib} / 1024.0 * ${hours} end), 0)`,
      disk: sql<string>`coalesce(sum(case when ${u.state} in ('running', 'paused') then ${u.diskBytes} / 1073741824.0 * ${hours} end), 0)`,
      snap: sql<string>`coalesce(sum(case when ${u.state} = 'suspended' then ${u.diskBytes} / 1073741824.0 * ${hours} / ${HOURS_PER_MONTH} end), 0)`,
    })
    .from(u)
    .where(and(eq(u.tenantId, tenantId), lt(u.startedAt, to), or(isNull(u.endedAt), gt(u.endedAt, from))));
  return {
    cpu_core_hours: Number(row?.cpu ?? 0),
    ram_gb_hours: Number(row?.ram ?? 0),
    disk_gb_hours: Number(row?.disk ?? 0),
    snapshot_gb_months: Number(row?.snap ?? 0),
  };
}
