/**
 * A tenant's home region: where its sandboxes are placed and its templates built, whichever
 * gateway serves the call (docs/regions.md "Rules of regions"). Fixed when the tenant is created
 * (gateway/auth/keys.ts `ensureTenant`).
 */
import { eq } from "drizzle-orm";
import type { AgentHostApi } from "../../contracts/agent/api.ts";
import { tenants } from "../../db/schema/tenants.ts";
import type { Deps } from "../deps.ts";

/**
 * The home region of `tenantId`. The public catalog (null) and a tenant made before regions
 * existed (no region on its row) are served in this gateway's default region (`config.region`).
 */
export async function homeRegion(
  deps: Pick<Deps, "db" | "config">,
  tenantId: string | null,
): Promise<string> {
  if (tenantId === null) return deps.config.region;
  return (await ownRegion(deps, tenantId)) ?? deps.config.region;
}

/** The home region on `tenantId`'s row; null for a tenant without one (made before regions). */
export async function ownRegion(deps: Pick<Deps, "db">, tenantId: string): Promise<string | null> {
  const [row] = await deps.db
    .select({ region: tenants.region })
    .from(tenants)
    .where(eq(tenants.id, tenantId));
  return row?.region ?? null;
}

/** The calls that name no VM, on the agents of `tenantId`'s home region that serve it (none: every one). */
export async function hostOf(
  deps: Pick<Deps, "db" | "config" | "placement">,
  tenantId: string | null,
): Promise<AgentHostApi> {
  return deps.placement.hostIn(await homeRegion(deps, tenantId), tenantId ?? undefined);
}
