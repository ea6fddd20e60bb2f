/**
 * Templates reach agents that join after their bake (docs/templates.md "Agents that join
 * later"). A bake builds on the agents live at that moment; an agent enrolled or back later
 * reports, in each heartbeat, the templates ready on it. When one lacks a ready template that it
 * may run (its region's tenants', public or its owner's: an agent owned by a tenant runs none of
 * another's), the gateway that heard the beat asks it to build that template from the stored
 * source: the OCI reference and ready spec the bake was given. So every agent that may place the
 * template comes to hold it, and placement, which prefers agents that hold it, sends creates to
 * the others meanwhile (the template stays Live: it runs where it is ready).
 *
 * What cannot be rebuilt this way: an uploaded image (the sessions API's upload is not kept after
 * its build) and a bake whose registry needed the tenant's `registry_auth` (credentials are never
 * stored): the agent's build of it fails, and the pair is not tried again for
 * CATCH_UP_RETRY_MS. Each agent is looked at once per CATCH_UP_EVERY_MS at most, and at most
 * CATCH_UP_BUILDS_PER_PASS builds are asked of it at a time, so a fleet joining at once costs
 * each gateway a few queries per agent per half minute.
 */
import { and, eq, isNotNull, isNull } from "drizzle-orm";
import type { TemplateSource } from "../../contracts/agent/api.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { agents } from "../../db/schema/agents.ts";
import { templates } from "../../db/schema/templates.ts";
import { tenants } from "../../db/schema/tenants.ts";
import type { Deps } from "../deps.ts";

/** An agent is looked at for missing templates at most this often (every 6th 5 s heartbeat). */
export const CATCH_UP_EVERY_MS = 30_000;
/** A build asked of an agent that did not take or failed it is not asked again for this long. */
export const CATCH_UP_RETRY_MS = 10 * 60_000;
/** Builds asked of one agent per look: a new agent gets the catalog in a few minutes, not all at once. */
export const CATCH_UP_BUILDS_PER_PASS = 4;

type TemplateRow = typeof templates.$inferSelect;

type OciSource = Extract<TemplateSource, { kind: "oci" }>;

/**
 * What an OCI template is built from, as its row stores it: the reference, the tenant and the
 * ready spec. A bake adds its credentials and fan-out hints (core/templates.ts); a rebuild on an
 * agent that joined later has neither (credentials are never stored; the hints were for the first
 * rollout). Undefined for an uploaded image.
 */
export function ociSourceOf(row: TemplateRow): OciSource | undefined {
  if (row.image === null) return undefined;
  const spec = row.spec as { ready?: unknown };
  const source: OciSource = { kind: "oci", image: row.image };
  if (row.tenantId !== null) source.tenantId = row.tenantId;
  if (spec.ready !== undefined) source.ready = spec.ready as NonNullable<typeof source.ready>;
  return source;
}

export class TemplateCatchUp {
  private readonly lookedAt = new Map<string, number>();
  private readonly asked = new Map<string, number>();
  private readonly running = new Set<string>();

  constructor(
    private readonly deps: Pick<Deps, "db" | "clock" | "placement" | "config">,
    private readonly log: (line: string) => void,
  ) {}

  /** An accepted heartbeat of `agentId`: looks at it if its turn has come (never waits for it). */
  onHeartbeat(agentId: string): void {
    const now = this.deps.clock();
    if (this.running.has(agentId) || now - (this.lookedAt.get(agentId) ?? 0) < CATCH_UP_EVERY_MS) return;
    this.lookedAt.set(agentId, now);
    this.running.add(agentId);
    void this.look(agentId)
      .catch((err) => this.log(`template catch-up on agent ${agentId}: ${describeError(err)}`))
      .finally(() => this.running.delete(agentId));
  }

  /** Asks agent `agentId` to build the ready templates it may run and does not report. */
  async look(agentId: string): Promise<string[]> {
    const { db } = this.deps;
    const [agent] = await db.select().from(agents).where(eq(agents.id, agentId));
    if (!agent?.keyId) return [];
    const held = new Set(agent.templates);
    const rows = await db
      .select({ t: templates, region: tenants.region })
      .from(templates)
      .leftJoin(tenants, eq(templates.tenantId, tenants.id))
      .where(and(eq(templates.status, "ready"), isNull(templates.deletedAt), isNotNull(templates.image)));
    const now = this.deps.clock();
    const missing = rows.filter(({ t, region }) => {
      if (held.has(t.agentRef)) return false;
      // Its tenant's home region (no region: served in this gateway's default); public: any.
      if (t.tenantId !== null && (region ?? this.deps.config.region) !== agent.region) return false;
      if (agent.ownerTenant !== null && t.tenantId !== agent.ownerTenant && t.tenantId !== null) return false;
      return (
        now - (this.asked.get(`${agentId} ${t.agentRef}`) ?? Number.NEGATIVE_INFINITY) >= CATCH_UP_RETRY_MS
      );
    });
    const host = this.deps.placement.hostOn(agentId);
    const started: string[] = [];
    for (const { t } of missing.slice(0, CATCH_UP_BUILDS_PER_PASS)) {
      const source = ociSourceOf(t);
      if (!source) continue;
      this.asked.set(`${agentId} ${t.agentRef}`, now);
      try {
        await host.buildTemplate(t.agentRef, source);
        started.push(t.agentRef);
        this.log(
          `template ${t.id} (${t.agentRef}): building on agent ${agentId}, which joined after its bake`,
        );
      } catch (err) {
        // Already building there (a catch-up of another gateway): nothing to do.
        if (err instanceof SandboxdError && err.code === "conflict") continue;
        this.log(`template ${t.id}: agent ${agentId} did not take its catch-up build: ${describeError(err)}`);
      }
    }
    return started;
  }
}
