/**
 * Templates reach agents that join after their bake (docs/templates.md "Agents that join
 * later"). A bake builds on the agents live at that moment; an agent enrolled or back later
 * reports, in each heartbeat, the templates ready on it. When one lacks a ready template that it
 * may run (its region's tenants', public or its owner's: an agent owned by a tenant runs none of
 * another's), the gateway that heard the beat gives it that template:
 * - copied from an agent of the region that holds it and that the receiver may trust (the
 *   operator's, or one of the receiver's own owner): the gateway streams the holder's bundle into
 *   the receiver, so neither dials the other (a BYOC agent copies over its own link);
 * - else rebuilt from the stored source, the OCI reference and ready spec the bake was given.
 * So an uploaded image (not kept after its build) and a bake whose registry needed the tenant's
 * `registry_auth` (never stored) reach new agents too, as long as one agent holds them.
 *
 * Placement, which prefers agents that hold the template, sends creates to the others meanwhile
 * (the template stays Live: it runs where it is ready). Each agent is looked at once per
 * CATCH_UP_EVERY_MS at most, at most CATCH_UP_BUILDS_PER_PASS templates are given to it per
 * look, and a pair given once is not tried again for CATCH_UP_RETRY_MS, so a fleet joining at
 * once costs each gateway a few queries per agent per half minute. */
import { and, eq, isNotNull, isNull } from "drizzle-orm";
import type { TemplateSource } from "../../contracts/agent/api.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { agents } from "../../db/schema/agents.ts";
import { templates } from "../../db/schema/templates.ts";
import { tenants } from "../../db/schema/tenants.ts";
import type { Deps } from "../deps.ts";
import { sizesOf } from "./sizes.ts";

/** An agent is looked at for missing templates at most this often (every 6th 5 s heartbeat). */
export const CATCH_UP_EVERY_MS = 30_000;
/** A build asked of an agent that did not take or failed it is not asked again for this long. */
export const CATCH_UP_RETRY_MS = 10 * 60_000;
/** Builds asked of one agent per look: a new agent gets the catalog in a few minutes, not all at once. */
export const CATCH_UP_BUILDS_PER_PASS = 4;
/** Holders a copy is tried from before a rebuild: a second covers one that went away mid-copy. */
export const CATCH_UP_COPY_SOURCES = 2;
/**
 * How long a look waits for a staged copy to be read in (the bundle has crossed by then; reading
 * it in takes seconds: a 256 MiB RAM file and a base disk). Past it the copy goes on, counted
 * as given; a failure shows at the next look, when the agent still lacks the template.
 */
const COPY_SETTLE_MS = 120_000;
const COPY_POLL_MS = 500;

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
  // Every size class is built again (docs/templates.md "Size classes").
  const sizes = sizesOf(row);
  if (sizes.length > 0 && (row.spec as { sizes?: unknown }).sizes !== undefined) source.sizes = sizes;
  return source;
}

export class TemplateCatchUp {
  private readonly lookedAt = new Map<string, number>();
  private readonly asked = new Map<string, number>();
  /** When "nothing to copy or rebuild from" was last said of an agent and template. */
  private readonly told = new Map<string, number>();
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

  /**
   * Gives agent `agentId` the ready templates it may run and does not report: copied from an
   * agent that holds one, else rebuilt from its stored source. Answers the refs started.
   */
  async look(agentId: string): Promise<string[]> {
    const { db } = this.deps;
    const [agent] = await db.select().from(agents).where(eq(agents.id, agentId));
    if (!agent?.keyId) return [];
    const held = new Set(agent.templates);
    const rows = await db
      .select({ t: templates, region: tenants.region })
      .from(templates)
      .leftJoin(tenants, eq(templates.tenantId, tenants.id))
      .where(and(eq(templates.status, "ready"), isNull(templates.deletedAt)));
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
    if (missing.length === 0) return [];
    // Who may be copied from: agents of the same region (the gateway reaches those) that trust
    // nothing less than the receiver does: the operator's, or the receiver's own owner's.
    const peers = (
      await db
        .select()
        .from(agents)
        .where(and(eq(agents.region, agent.region), isNotNull(agents.keyId)))
    ).filter((p) => p.id !== agentId && (p.ownerTenant === null || p.ownerTenant === agent.ownerTenant));
    const started: string[] = [];
    let tried = 0;
    for (const { t } of missing) {
      if (tried >= CATCH_UP_BUILDS_PER_PASS) break;
      const sources = peers
        .filter((p) => p.templates.includes(t.agentRef))
        .sort((a, b) => (b.lastHeartbeatAt?.getTime() ?? 0) - (a.lastHeartbeatAt?.getTime() ?? 0));
      const source = ociSourceOf(t);
      // A template of several size classes is rebuilt when it can be: a bundle holds its default
      // class only (docs/templates.md "Size classes"), and a rebuild freezes every class.
      if (source?.sizes !== undefined && source.sizes.length > 1) sources.length = 0;
      if (sources.length === 0 && !source) {
        // Nothing to copy from yet (its holder has not reported it, or is gone) and nothing to
        // rebuild from: looked at again next time, said once per CATCH_UP_RETRY_MS.
        const key = `${agentId} ${t.agentRef}`;
        if (now - (this.told.get(key) ?? Number.NEGATIVE_INFINITY) >= CATCH_UP_RETRY_MS) {
          this.told.set(key, now);
          this.log(
            `template ${t.id}: agent ${agentId} lacks it and no agent holds it to copy from (an upload has no source to rebuild from)`,
          );
        }
        continue;
      }
      tried++;
      this.asked.set(`${agentId} ${t.agentRef}`, now);
      const how = await this.give(
        agentId,
        t,
        sources.map((p) => p.id),
        source,
      );
      if (how) started.push(t.agentRef);
    }
    return started;
  }

  /** One template onto one agent: a copy from the first source that serves it, else a rebuild. */
  private async give(
    agentId: string,
    t: TemplateRow,
    sources: string[],
    source: OciSource | undefined,
  ): Promise<"copy" | "build" | undefined> {
    const target = this.deps.placement.hostOn(agentId);
    for (const from of sources.slice(0, CATCH_UP_COPY_SOURCES)) {
      try {
        const bundle = await this.deps.placement.hostOn(from).exportTemplate(t.agentRef);
        await target.copyTemplate(t.agentRef, bundle);
      } catch (err) {
        // Already there or on its way (a catch-up of another gateway): nothing to do.
        if (err instanceof SandboxdError && err.code === "conflict") return undefined;
        this.log(
          `template ${t.id}: copying it from agent ${from} to ${agentId} failed: ${describeError(err)}`,
        );
        continue;
      }
      const outcome = await this.settled(agentId, t.agentRef);
      if (outcome.status === "ready") {
        this.log(
          `template ${t.id} (${t.agentRef}): copied from agent ${from} to ${agentId}, which joined after its bake`,
        );
        return "copy";
      }
      this.log(`template ${t.id}: its copy on agent ${agentId} ${outcome.status}: ${outcome.error ?? ""}`);
      break; // a copy the receiver refuses (another QEMU, say) fails alike from every source
    }
    if (!source) {
      this.log(
        `template ${t.id}: no agent could copy it to ${agentId} (an upload has no source to rebuild from)`,
      );
      return undefined;
    }
    try {
      await target.buildTemplate(t.agentRef, source);
      this.log(`template ${t.id} (${t.agentRef}): building on agent ${agentId}, which joined after its bake`);
      return "build";
    } catch (err) {
      if (err instanceof SandboxdError && err.code === "conflict") return undefined;
      this.log(`template ${t.id}: agent ${agentId} did not take its catch-up build: ${describeError(err)}`);
      return undefined;
    }
  }

  /** The copy's end on `agentId`, polled for at most COPY_SETTLE_MS (then reported as building). */
  private async settled(agentId: string, ref: string): Promise<{ status: string; error?: string }> {
    const deadline = this.deps.clock() + COPY_SETTLE_MS;
    for (;;) {
      let st: { status: string; error?: string };
      try {
        st = await this.deps.placement.hostOn(agentId).templateStatus(ref);
      } catch (err) {
        return { status: "unknown", error: describeError(err) };
      }
      if (st.status !== "building" || this.deps.clock() >= deadline) return st;
      await Bun.sleep(COPY_POLL_MS);
    }
  }
}
