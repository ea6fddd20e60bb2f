/**
 * `AgentRouter`: the gateway's view of many host agents (registry.ts keeps the registry).
 *
 * - Every placement names a region, the home region of the tenant it is for (placement.ts): the
 *   router reaches any region's agents through the `agents` table, so one gateway serves every
 *   tenant (docs/regions.md "Rules of regions").
 * - Placement (`placementOrder`, docs/agents-and-placement.md "Placement by free room and template locality"): live agents (heartbeat fresher than
 *   `staleAfterMs`) of the region with room for the VM: the heartbeat's free slots, vCPUs, memory
 *   and disk MINUS what any gateway placed there since that heartbeat (the `placed_*` columns of
 *   its `agents` row). A placement claims its room with one conditional UPDATE that checks the
 *   room left and adds the VM, so two gateways on one database never both take an agent's last
 *   room. Agents that report holding the template come first; among them (then among the rest)
 *   the first is the less loaded of two picked at random (power of two choices); cordoned agents
 *   are left out. The agent has the last word (`at_capacity`, and the next one is tried). None with room: 503 `at_capacity`.
 * - A sandbox's later calls go to the agent recorded on its row (`agentFor`); a stale or
 *   unregistered agent fails at once with 503 `agent_unavailable`, an unreachable one as soon as
 *   the connection is refused (AgentHttpClient), never a hang.
 * - Templates are built on every live agent of the region (an uploaded image is hard-linked once
 *   per agent, as each agent takes ownership of its file); status is `ready` once any of them has
 *   it ready. A create tries the next candidate when one has no room, lacks the template or
 *   refuses the connection, so an agent that is still building is simply skipped.
 *
 * As an `AgentHostApi` the router serves the calls that name no VM (templates, exec-once, health)
 * in its default region, and `hostIn(region)` serves them in any region;
 * as the gateway's `Placement` (placement.ts) it chooses the agent of a new VM (`firstChoice`,
 * `place`), and calls on a VM go to the agent on its record (`agentFor`, an `AgentVmApi`). Every call to an agent
 * is signed with that agent's own key (enrollment.ts); a revoked agent is neither live nor called.
 */
import { copyFile, link, rm } from "node:fs/promises";
import { setTimeout as sleep } from "node:timers/promises";
import { and, eq, gt, isNotNull, sql } from "drizzle-orm";
import type {
  AgentApi,
  AgentCopyApi,
  AgentHealth,
  AgentHostApi,
  AgentVmApi,
  CreatedVm,
  CreateVmOpts,
  ExecAction,
  OneShotResult,
  TemplateBuildStatus,
  TemplateRef,
  TemplateSource,
} from "../../contracts/agent/api.ts";
import { isDialUrl } from "../../contracts/agent/dial.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import type { AgentCallTelemetry } from "./agent-http.ts";
import { AgentHttpClient, type AgentTimeouts } from "./client.ts";
import type { DialHub } from "./dial-hub.ts";
import { deriveAgentKey } from "./enrollment.ts";
import { noLiveAgent, type Placement, type PlacementNeed } from "./placement.ts";
import { AGENT_STALE_AFTER_MS, type AgentRow, isLive, liveAgents } from "./registry.ts";

export interface AgentRouterOptions {
  db: Db;
  /** The gateway's agent secret, from which each agent's key is derived (enrollment.ts). */
  agentSecret: string;
  /** The default region (config.region): where the router's own `AgentHostApi` calls go. */
  region: string;
  staleAfterMs?: number;
  /**
   * How long a placement waits for an agent of the region to become live when none is
   * (gateway/config.ts AGENT_WAIT_MS); 0: refuse at once.
   */
  waitMs?: number;
  clock?: () => number;
  timeouts?: Partial<AgentTimeouts>;
  /** Draws of the power-of-two choice, uniform in [0, 1); tests pass a seeded one. */
  random?: () => number;
  /**
   * How to reach an enrolled, live agent; default an `AgentHttpClient` to its URL signed with its
   * key. Tests give in-memory agents here to run the router's placement over the real `agents`
   * table without HTTP servers.
   */
  connect?: (row: AgentRow & { keyId: string }, key: string) => AgentApi;
  /**
   * The links of agents that dial out (URL `dial://<id>`, dial-hub.ts): such an agent is reached
   * through its link to this gateway, and is not live here without one. None: no agent may dial.
   */
  dial?: DialHub;
  /** Where agent calls and placements are counted, timed and traced. */
  telemetry?: AgentCallTelemetry;
}

/** What a VM claims on an agent, every field filled in. */
type Need = Required<Omit<PlacementNeed, "template" | "tenant">> & { template: string | undefined };

function fullNeed(n: PlacementNeed): Need {
  const memMib = n.memMib ?? 0;
  return { template: n.template, vcpus: n.vcpus ?? 0, memMib, diskMib: n.diskMib ?? memMib };
}

/** An agent's room now: its last heartbeat's free resources less what was placed since. */
export function roomOf(row: AgentRow): { slots: number; vcpus: number; memMib: number; diskMib: number } {
  return {
    slots: row.slotsFree - row.placedSlots,
    vcpus: row.vcpusFree - row.placedVcpus,
    memMib: row.memMibFree - row.placedMemMib,
    diskMib: row.diskMibFree === null ? Number.POSITIVE_INFINITY : row.diskMibFree - row.placedDiskMib,
  };
}

function fits(row: AgentRow, need: Need): boolean {
  const r = roomOf(row);
  return r.slots >= 1 && r.vcpus >= need.vcpus && r.memMib >= need.memMib && r.diskMib >= need.diskMib;
}

/** Share of the agent's slots in use or placed (1: full; an agent reporting no slots counts as full). */
function loadOf(row: AgentRow): number {
  return row.slotsTotal > 0 ? 1 - Math.max(0, roomOf(row).slots) / row.slotsTotal : 1;
}

function byLoad(a: AgentRow, b: AgentRow): number {
  return loadOf(a) - loadOf(b) || roomOf(b).slots - roomOf(a).slots || (a.id < b.id ? -1 : 1);
}

/**
 * How often a placement that waits for an agent looks again. A heartbeat is a row in the
 * database, which another gateway replica may have written, so the wait reads the table rather
 * than listening to this process's heartbeats; four reads a second of a small indexed table per
 * waiting call, and an agent is used within a quarter second of its first beat.
 */
const LIVE_POLL_MS = 250;

/** Errors after which the same call may go to another agent: nothing was started there. */
function retryElsewhere(err: unknown): boolean {
  if (!(err instanceof SandboxdError)) return false;
  if (err.code === "agent_unavailable") return err.details?.timedOut !== true;
  return err.code === "at_capacity" || err.code === "not_found" || err.code === "template_not_ready";
}

export class AgentRouter implements AgentHostApi, Placement {
  readonly region: string;
  private readonly db: Db;
  private readonly agentSecret: string;
  private readonly staleAfterMs: number;
  private readonly waitMs: number;
  private readonly clock: () => number;
  private readonly timeouts: Partial<AgentTimeouts> | undefined;
  private readonly random: () => number;
  private readonly connect: ((row: AgentRow & { keyId: string }, key: string) => AgentApi) | undefined;
  private readonly clients = new Map<string, AgentApi>();
  private readonly dial: DialHub | undefined;
  private readonly telemetry: AgentCallTelemetry;

  constructor(opts: AgentRouterOptions) {
    this.db = opts.db;
    this.agentSecret = opts.agentSecret;
    this.region = opts.region;
    this.staleAfterMs = opts.staleAfterMs ?? AGENT_STALE_AFTER_MS;
    this.waitMs = opts.waitMs ?? 0;
    this.clock = opts.clock ?? Date.now;
    this.timeouts = opts.timeouts;
    this.random = opts.random ?? Math.random;
    this.connect = opts.connect;
    this.dial = opts.dial;
    this.telemetry = opts.telemetry ?? {};
  }

  /** Rows come from `live`/`isLive`, which keep only enrolled agents (a key id). */
  private client(row: AgentRow): AgentApi {
    const keyId = row.keyId;
    if (keyId === null) throw new SandboxdError("agent_unavailable", `agent ${row.id} is not enrolled`);
    const baseUrl = isDialUrl(row.url) ? this.dial?.baseUrl(row.id) : row.url;
    if (baseUrl === undefined)
      throw new SandboxdError(
        "agent_unavailable",
        `agent ${row.id} dials out and has no link to this gateway`,
        {
          details: { agentId: row.id, retryAfterSeconds: 5 },
        },
      );
    const k = `${row.id} ${baseUrl} ${keyId}`;
    let c = this.clients.get(k);
    if (!c) {
      const key = deriveAgentKey(this.agentSecret, row.id, keyId);
      c = this.connect
        ? this.connect({ ...row, keyId }, key)
        : new AgentHttpClient({
            baseUrl,
            agentId: row.id,
            key,
            ...(this.timeouts ? { timeouts: this.timeouts } : {}),
            telemetry: this.telemetry,
          });
      this.clients.set(k, c);
    }
    return c;
  }

  /**
   * Live agents of `region` this gateway can reach (a dial-out agent only through its link here),
   * and of those, with `tenant`, the ones that may take its VMs and templates: its own agents when
   * it has any live (a BYOC pool is the tenant's alone, and its VMs stay in it), else the
   * operator's. Without `tenant` (public templates, health): every one.
   */
  private async live(region = this.region, tenant?: string): Promise<AgentRow[]> {
    const rows = (await liveAgents(this.db, region, this.clock(), this.staleAfterMs)).filter(
      (r) => !isDialUrl(r.url) || this.dial?.linked(r.id) === true,
    );
    if (tenant === undefined) return rows;
    const own = rows.filter((r) => r.ownerTenant === tenant);
    return own.length > 0 ? own : rows.filter((r) => r.ownerTenant === null);
  }

  /**
   * Live agents of `region` with room for `need` (`roomOf`), those reporting `need.template`
   * first, each group least loaded first (smallest share of slots in use or placed, then most
   * slots free). An agent with too little room is left out: its room counts every gateway's
   * placements since its heartbeat, and a VM deleted since then only makes it look fuller than it
   * is until the next beat (5 s).
   */
  async candidates(region = this.region, need: PlacementNeed = {}): Promise<AgentRow[]> {
    const n = fullNeed(need);
    // A cordoned agent keeps its VMs and its templates, and takes no new VM (docs/fleet.md "Cordon and drain").
    // A VM named for no tenant goes to an operator's agent only: never into a tenant's own pool.
    const pool =
      need.tenant === undefined
        ? (await this.live(region)).filter((r) => r.ownerTenant === null)
        : await this.live(region, need.tenant);
    const rows = pool.filter((r) => r.cordonedAt === null && fits(r, n)).sort(byLoad);
    const holds = (r: AgentRow) => n.template !== undefined && r.templates.includes(n.template);
    return [...rows.filter(holds), ...rows.filter((r) => !holds(r))];
  }

  /**
   * `candidates` in the order a placement tries them: in each group (holding the template, then
   * not), the first is the less loaded of two drawn at random (power of two choices), the rest
   * follow least loaded first. Not simply the least loaded: every gateway would send its creates
   * to the same agent, contending for its row and piling a burst on one host; two random draws
   * keep the maximum load within a small margin of the mean (docs/agents-and-placement.md "Placement by free room and template locality").
   * None: 503 `at_capacity`.
   */
  async placementOrder(region = this.region, need: PlacementNeed = {}): Promise<AgentRow[]> {
    // While the region has no live agent (one that is starting), wait up to `waitMs` for one
    // (docs/templates.md "Waiting for an agent"); live agents without room answer at once.
    const deadline = performance.now() + this.waitMs;
    const look = async () => {
      const rows = await this.candidates(region, need);
      return { rows, live: rows.length > 0 ? rows.length : (await this.live(region, need.tenant)).length };
    };
    let { rows, live } = await look();
    while (live === 0 && performance.now() < deadline) {
      await sleep(Math.min(LIVE_POLL_MS, deadline - performance.now()));
      ({ rows, live } = await look());
    }
    if (rows.length === 0) {
      const waited = this.waitMs > 0 ? ` (waited ${this.waitMs / 1000} s for one)` : "";
      const why =
        live === 0 ? `no live agent in region ${region}${waited}` : `no agent in region ${region} has room`;
      throw new SandboxdError("at_capacity", `${why}; retry with backoff`, {
        details: { region, retryAfterSeconds: 5 },
      });
    }
    const holds = (r: AgentRow) => need.template !== undefined && r.templates.includes(need.template);
    return [...this.twoChoices(rows.filter(holds)), ...this.twoChoices(rows.filter((r) => !holds(r)))];
  }

  /** `rows` (least loaded first) with the better of two random draws moved to the front. */
  private twoChoices(rows: AgentRow[]): AgentRow[] {
    if (rows.length < 2) return rows;
    const i = Math.floor(this.random() * rows.length);
    let j = Math.floor(this.random() * (rows.length - 1));
    if (j >= i) j++;
    const best = Math.min(i, j);
    return [rows[best]!, ...rows.slice(0, best), ...rows.slice(best + 1)];
  }

  /** Placement: the agent of `region` a placement would try first, or 503 `at_capacity`; nothing is claimed. */
  async firstChoice(region = this.region, need: PlacementNeed = {}): Promise<string> {
    return (await this.placementOrder(region, need))[0]!.id;
  }

  /**
   * Claims `need` on agent `id` if it still has room: one UPDATE whose WHERE checks the room left
   * (heartbeat free less placed) and liveness, so of two gateways racing for an agent's last room
   * one updates the row and the other, re-checking the row after the first's commit, matches
   * nothing. Returns the heartbeat the claim counts against, or undefined when there was no room.
   */
  private async claim(id: string, n: Need): Promise<Date | undefined> {
    const a = agents;
    const [row] = await this.db
      .update(a)
      .set({
        placedSlots: sql`${a.placedSlots} + 1`,
        placedVcpus: sql`${a.placedVcpus} + ${n.vcpus}`,
        placedMemMib: sql`${a.placedMemMib} + ${n.memMib}`,
        placedDiskMib: sql`${a.placedDiskMib} + ${n.diskMib}`,
      })
      .where(
        and(
          eq(a.id, id),
          isNotNull(a.keyId),
          gt(a.lastHeartbeatAt, new Date(this.clock() - this.staleAfterMs)),
          sql`${a.slotsFree} - ${a.placedSlots} >= 1`,
          sql`${a.vcpusFree} - ${a.placedVcpus} >= ${n.vcpus}`,
          sql`${a.memMibFree} - ${a.placedMemMib} >= ${n.memMib}`,
          sql`(${a.diskMibFree} is null or ${a.diskMibFree} - ${a.placedDiskMib} >= ${n.diskMib})`,
        ),
      )
      .returning({ hb: a.lastHeartbeatAt });
    return row?.hb ?? undefined;
  }

  /** Gives back a claim whose VM was not started, unless a heartbeat has since reset the count. */
  private async unclaim(id: string, hb: Date, n: Need): Promise<void> {
    const a = agents;
    await this.db
      .update(a)
      .set({
        placedSlots: sql`greatest(0, ${a.placedSlots} - 1)`,
        placedVcpus: sql`greatest(0, ${a.placedVcpus} - ${n.vcpus})`,
        placedMemMib: sql`greatest(0, ${a.placedMemMib} - ${n.memMib})`,
        placedDiskMib: sql`greatest(0, ${a.placedDiskMib} - ${n.diskMib})`,
      })
      .where(and(eq(a.id, id), eq(a.lastHeartbeatAt, hb)));
  }

  /**
   * Placement: claims room on the first candidate that still has it and runs `fn` there; returns
   * which agent took it. When `fn` fails with nothing started (no template there, connection
   * refused) the claim is given back and the next candidate tried; an agent that answers
   * `at_capacity` keeps the claim (it is full: its next heartbeat says so). The last error is
   * thrown when every candidate refused, `at_capacity` when none had room left to claim.
   */
  async place<T>(
    fn: (api: AgentHostApi) => Promise<T>,
    region = this.region,
    need: PlacementNeed = {},
  ): Promise<{ agentId: string; result: T }> {
    const counted = (outcome: string) =>
      this.telemetry.metrics?.inc(
        "sandboxd_gateway_placements_total",
        "Placements of VMs on agents by region and outcome: placed, or the error code that ended them.",
        { region, outcome },
      );
    try {
      const placed = await this.placeIn(fn, region, need);
      counted("placed");
      return placed;
    } catch (err) {
      counted(err instanceof SandboxdError ? err.code : "internal");
      throw err;
    }
  }

  private async placeIn<T>(
    fn: (api: AgentHostApi) => Promise<T>,
    region: string,
    need: PlacementNeed,
  ): Promise<{ agentId: string; result: T }> {
    const n = fullNeed(need);
    const rows = await this.placementOrder(region, need);
    let last: unknown = new SandboxdError(
      "at_capacity",
      `every agent in region ${region} was filled meanwhile; retry with backoff`,
      { details: { region, retryAfterSeconds: 5 } },
    );
    for (const row of rows) {
      const hb = await this.claim(row.id, n);
      if (hb === undefined) continue;
      try {
        return { agentId: row.id, result: await fn(this.client(row)) };
      } catch (err) {
        last = err;
        if (!retryElsewhere(err)) throw err;
        if (!(err instanceof SandboxdError && err.code === "at_capacity")) {
          try {
            await this.unclaim(row.id, hb, n);
          } catch {
            // Dropped: a claim not given back only makes this agent look fuller until its next
            // heartbeat resets the count, within 5 s; the create's own error is what matters.
          }
        }
      }
    }
    throw last;
  }

  /** Placement: the calls that name no VM on agent `agentId` alone (a catch-up build). */
  hostOn(agentId: string): AgentHostApi & AgentCopyApi {
    const lookup = () => this.liveClient(agentId);
    return {
      createSandbox: async (t, o) => (await lookup()).createSandbox(t, o),
      execOnce: async (t, a) => (await lookup()).execOnce(t, a),
      buildTemplate: async (t, src) => (await lookup()).buildTemplate(t, src),
      templateStatus: async (t) => (await lookup()).templateStatus(t),
      deleteTemplate: async (t) => (await lookup()).deleteTemplate(t),
      expectWidth: async (t, w) => (await lookup()).expectWidth(t, w),
      releaseTemplate: async (t) => (await lookup()).releaseTemplate(t),
      health: async () => (await lookup()).health(),
      exportTemplate: async (t) => (await lookup()).exportTemplate(t),
      copyTemplate: async (t, b) => (await lookup()).copyTemplate(t, b),
    };
  }

  /** The client of agent `agentId` while it is live; stale or unknown: 503 `agent_unavailable`. */
  private async liveClient(agentId: string): Promise<AgentApi> {
    const [row] = await this.db.select().from(agents).where(eq(agents.id, agentId));
    if (!row || !isLive(row, this.clock(), this.staleAfterMs)) {
      throw new SandboxdError(
        "agent_unavailable",
        `agent ${agentId} has not reported for over ${this.staleAfterMs / 1000} s; retry later`,
        { details: { agentId, retryAfterSeconds: 5 } },
      );
    }
    return this.client(row);
  }

  /** Placement: the agent a sandbox lives on; stale or unknown: 503 `agent_unavailable` at once. */
  agentFor(agentId: string): AgentVmApi {
    const lookup = () => this.liveClient(agentId);
    return {
      exec: async (v, a) => (await lookup()).exec(v, a),
      execStream: async (v, a, o) => (await lookup()).execStream(v, a, o),
      fork: async (v, n) => (await lookup()).fork(v, n),
      suspend: async (v) => (await lookup()).suspend(v),
      resume: async (v) => (await lookup()).resume(v),
      takeSnapshot: async (v, r) => (await lookup()).takeSnapshot(v, r),
      restoreSnapshot: async (v, r) => (await lookup()).restoreSnapshot(v, r),
      createFromSnapshot: async (r, o) => (await lookup()).createFromSnapshot(r, o),
      deleteSnapshot: async (r) => (await lookup()).deleteSnapshot(r),
      destroy: async (v, o) => (await lookup()).destroy(v, o),
      openTunnel: async (v, p, pr) => (await lookup()).openTunnel(v, p, pr),
      startProcess: async (v, r) => (await lookup()).startProcess(v, r),
      listProcesses: async (v) => (await lookup()).listProcesses(v),
      processLogs: async (v, n) => (await lookup()).processLogs(v, n),
      followProcess: async (v, n, o) => (await lookup()).followProcess(v, n, o),
      processStdin: async (v, n, i) => (await lookup()).processStdin(v, n, i),
      killProcess: async (v, n) => (await lookup()).killProcess(v, n),
      openPty: async (v, o) => (await lookup()).openPty(v, o),
      files: async (v, f) => (await lookup()).files(v, f),
      fsOp: async (v, o) => (await lookup()).fsOp(v, o),
      listVms: async () => (await lookup()).listVms(),
      listSnapshots: async () => (await lookup()).listSnapshots(),
      metrics: async (v) => (await lookup()).metrics(v),
      setEgress: async (v, a) => (await lookup()).setEgress(v, a),
    };
  }

  // ---- AgentHostApi: calls that name no VM ----------------------------------------------------

  /** Placement: the calls that name no VM, on the live agents of `region`. */
  hostIn(region: string, tenant?: string): AgentHostApi {
    const need = (t: TemplateRef): PlacementNeed =>
      tenant === undefined ? { template: t } : { template: t, tenant };
    return {
      createSandbox: async (t, o) => (await this.place((a) => a.createSandbox(t, o), region, need(t))).result,
      execOnce: async (t, a) => (await this.place((h) => h.execOnce(t, a), region, need(t))).result,
      buildTemplate: (t, src) => this.buildIn(region, t, src, tenant),
      templateStatus: (t) => this.statusIn(region, t, tenant),
      // A delete or release reaches every agent of the region: one that holds it from before
      // the tenant's own pool went live (or from another pool) must not keep it.
      deleteTemplate: (t) => this.everyLive(region, (a) => a.deleteTemplate(t)),
      expectWidth: (t, w) => this.everyLive(region, (a) => a.expectWidth(t, w), tenant),
      releaseTemplate: (t) => this.everyLive(region, (a) => a.releaseTemplate(t)),
      health: () => this.healthIn(region),
    };
  }

  createSandbox(template: TemplateRef, opts: CreateVmOpts): Promise<CreatedVm> {
    return this.hostIn(this.region).createSandbox(template, opts);
  }

  execOnce(template: TemplateRef, action: ExecAction): Promise<OneShotResult> {
    return this.hostIn(this.region).execOnce(template, action);
  }

  buildTemplate(template: TemplateRef, source: TemplateSource): Promise<void> {
    return this.buildIn(this.region, template, source);
  }

  /**
   * Every live agent of the region; fails only if none took it. With none live it fails at once
   * with 503 `agent_unavailable` and leaves an upload's file in place: nothing was taken, and the
   * caller waits for an agent and tries again (gateway/core/templates.ts).
   */
  private async buildIn(
    region: string,
    template: TemplateRef,
    source: TemplateSource,
    tenant?: string,
  ): Promise<void> {
    const rows = await this.live(region, tenant);
    if (rows.length === 0) {
      throw new SandboxdError("agent_unavailable", `no live agent in region ${region} to build on`, {
        details: { region, noLiveAgent: true, retryAfterSeconds: 5 },
      });
    }
    try {
      const sources: TemplateSource[] = [];
      for (let i = 0; i < rows.length; i++) {
        if (source.kind === "upload" && i < rows.length - 1) {
          const path = `${source.path}.${i}`;
          await link(source.path, path).catch(() => copyFile(source.path, path));
          sources.push({ ...source, path });
        } else sources.push(source);
      }
      const results = await Promise.allSettled(
        rows.map((r, i) => this.client(r).buildTemplate(template, sources[i]!)),
      );
      const ok = results.some((r) => r.status === "fulfilled");
      if (!ok) throw (results[0] as PromiseRejectedResult).reason;
    } finally {
      if (source.kind === "upload") await rm(source.path, { force: true });
    }
  }

  templateStatus(template: TemplateRef): Promise<TemplateBuildStatus> {
    return this.statusIn(this.region, template);
  }

  private async statusIn(
    region: string,
    template: TemplateRef,
    tenant?: string,
  ): Promise<TemplateBuildStatus> {
    const settled = await Promise.allSettled(
      (await this.live(region, tenant)).map((r) => this.client(r).templateStatus(template)),
    );
    const got = settled.flatMap((s) => (s.status === "fulfilled" ? [s.value] : []));
    const ready = got.find((s) => s.status === "ready");
    if (ready) return ready;
    const building = got.find((s) => s.status === "building");
    if (building) return building;
    if (got[0]) return got[0];
    const err = settled.find((s): s is PromiseRejectedResult => s.status === "rejected");
    throw err?.reason ?? noLiveAgent(region);
  }

  private async everyLive(
    region: string,
    fn: (a: AgentHostApi) => Promise<void>,
    tenant?: string,
  ): Promise<void> {
    const settled = await Promise.allSettled(
      (await this.live(region, tenant)).map((r) => fn(this.client(r))),
    );
    for (const s of settled) {
      if (s.status === "rejected" && !(s.reason instanceof SandboxdError && s.reason.code === "not_found")) {
        throw s.reason;
      }
    }
  }

  /** On every live agent of the region (an agent that is down keeps its copy: see docs). */
  deleteTemplate(template: TemplateRef): Promise<void> {
    return this.everyLive(this.region, (a) => a.deleteTemplate(template));
  }

  expectWidth(template: TemplateRef, width: number): Promise<void> {
    return this.everyLive(this.region, (a) => a.expectWidth(template, width));
  }

  releaseTemplate(template: TemplateRef): Promise<void> {
    return this.everyLive(this.region, (a) => a.releaseTemplate(template));
  }

  health(): Promise<AgentHealth> {
    return this.healthIn(this.region);
  }

  /** The region as a whole: ok while one live agent answers; capacity summed over them. */
  private async healthIn(region: string): Promise<AgentHealth> {
    const settled = await Promise.allSettled((await this.live(region)).map((r) => this.client(r).health()));
    const got = settled.flatMap((s) => (s.status === "fulfilled" ? [s.value] : []));
    const sum = (f: (h: AgentHealth) => number) => got.reduce((n, h) => n + f(h), 0);
    // The region is as strong as its weakest host: one agent under TCG makes it `tcg`.
    const accels = got.map((h) => h.accel);
    const accel = accels.includes("tcg")
      ? "tcg"
      : accels.length && accels.every((a) => a === "kvm")
        ? "kvm"
        : undefined;
    return {
      ...(accel ? { accel } : {}),
      ok: got.some((h) => h.ok),
      version: got[0]?.version ?? "none",
      capacity: {
        slotsFree: sum((h) => h.capacity.slotsFree),
        slotsTotal: sum((h) => h.capacity.slotsTotal),
        vcpusFree: sum((h) => h.capacity.vcpusFree),
        memMibFree: sum((h) => h.capacity.memMibFree),
      },
    };
  }
}
