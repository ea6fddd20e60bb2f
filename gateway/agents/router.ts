/**
 * `AgentRouter`: the gateway's view of many host agents (registry.ts keeps the registry).
 *
 * - Every placement names a region, the home region of the tenant it is for (placement.ts): the
 *   router reaches any region's agents through the `agents` table, so one gateway serves every
 *   tenant (docs/regions.md "Rules of regions").
 * - Placement (`candidates`): live agents (heartbeat fresher than `staleAfterMs`) of the region,
 *   least-loaded first (smallest share of slots in use, then most slots free). Room is estimated
 *   as the heartbeat's `slotsFree` minus what this gateway placed there since that heartbeat; the
 *   agent has the last word (`at_capacity`, and the next one is tried). No live agent, or every
 *   one full: 503 `at_capacity`.
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
import { eq } from "drizzle-orm";
import type {
  AgentApi,
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
import { SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { AgentHttpClient, type AgentTimeouts } from "./client.ts";
import { deriveAgentKey } from "./enrollment.ts";
import { noLiveAgent, type Placement } from "./placement.ts";
import { AGENT_STALE_AFTER_MS, type AgentRow, isLive, liveAgents } from "./registry.ts";

export interface AgentRouterOptions {
  db: Db;
  /** The gateway's agent secret, from which each agent's key is derived (enrollment.ts). */
  agentSecret: string;
  /** The default region (config.region): where the router's own `AgentHostApi` calls go. */
  region: string;
  staleAfterMs?: number;
  clock?: () => number;
  timeouts?: Partial<AgentTimeouts>;
  /**
   * How to reach an enrolled, live agent; default an `AgentHttpClient` to its URL signed with its
   * key. Tests give in-memory agents here to run the router's placement over the real `agents`
   * table without HTTP servers.
   */
  connect?: (row: AgentRow & { keyId: string }, key: string) => AgentApi;
}

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
  private readonly clock: () => number;
  private readonly timeouts: Partial<AgentTimeouts> | undefined;
  private readonly clients = new Map<string, AgentApi>();
  private readonly connect: ((row: AgentRow & { keyId: string }, key: string) => AgentApi) | undefined;
  /** Per agent: creates placed since its heartbeat at `hb` (ms). */
  private readonly placed = new Map<string, { hb: number; n: number }>();

  constructor(opts: AgentRouterOptions) {
    this.db = opts.db;
    this.agentSecret = opts.agentSecret;
    this.region = opts.region;
    this.staleAfterMs = opts.staleAfterMs ?? AGENT_STALE_AFTER_MS;
    this.clock = opts.clock ?? Date.now;
    this.timeouts = opts.timeouts;
    this.connect = opts.connect;
  }

  /** Rows come from `live`/`isLive`, which keep only enrolled agents (a key id). */
  private client(row: AgentRow): AgentApi {
    const keyId = row.keyId;
    if (keyId === null) throw new SandboxdError("agent_unavailable", `agent ${row.id} is not enrolled`);
    const k = `${row.id} ${row.url} ${keyId}`;
    let c = this.clients.get(k);
    if (!c) {
      const key = deriveAgentKey(this.agentSecret, row.id, keyId);
      c =
        this.connect?.({ ...row, keyId }, key) ??
        new AgentHttpClient({
          baseUrl: row.url,
          agentId: row.id,
          key,
          ...(this.timeouts ? { timeouts: this.timeouts } : {}),
        });
      this.clients.set(k, c);
    }
    return c;
  }

  private live(region = this.region): Promise<AgentRow[]> {
    return liveAgents(this.db, region, this.clock(), this.staleAfterMs);
  }

  private freeSlots(row: AgentRow): number {
    const hb = row.lastHeartbeatAt?.getTime() ?? 0;
    const p = this.placed.get(row.id);
    return row.slotsFree - (p && p.hb === hb ? p.n : 0);
  }

  private notePlaced(row: AgentRow): void {
    const hb = row.lastHeartbeatAt?.getTime() ?? 0;
    const p = this.placed.get(row.id);
    this.placed.set(row.id, { hb, n: p && p.hb === hb ? p.n + 1 : 1 });
  }

  /**
   * Live agents of `region`, most room first (smallest share of slots in use, then most slots
   * free). Nobody is left out for looking full: the estimate is a heartbeat up to 5 s old minus
   * what was placed since, and sandboxes deleted in between are not in it, so an agent that
   * looks full may have room. The agent itself is authoritative: one that is really full answers
   * `at_capacity` at once and `place` moves on to the next.
   */
  async candidates(region = this.region): Promise<AgentRow[]> {
    const rows = await this.live(region);
    const free = (r: AgentRow) => Math.max(0, this.freeSlots(r));
    const load = (r: AgentRow) => (r.slotsTotal > 0 ? 1 - free(r) / r.slotsTotal : 1);
    return rows.sort((a, b) => load(a) - load(b) || free(b) - free(a) || (a.id < b.id ? -1 : 1));
  }

  /** `candidates`, or 503 `at_capacity` when the region has no live agent. */
  async placementOrder(region = this.region): Promise<AgentRow[]> {
    const rows = await this.candidates(region);
    if (rows.length === 0) throw noLiveAgent(region);
    return rows;
  }

  /** Placement: the least-loaded live agent of the region, or 503 `at_capacity`. */
  async firstChoice(region = this.region): Promise<string> {
    return (await this.placementOrder(region))[0]!.id;
  }

  /**
   * Placement: runs `fn` on the first candidate that takes it; returns which agent did. The last
   * error is thrown when every candidate refused (no room anywhere reads as `at_capacity`).
   */
  async place<T>(
    fn: (api: AgentHostApi) => Promise<T>,
    region = this.region,
  ): Promise<{ agentId: string; result: T }> {
    const rows = await this.placementOrder(region);
    let last: unknown;
    for (const row of rows) {
      this.notePlaced(row);
      try {
        return { agentId: row.id, result: await fn(this.client(row)) };
      } catch (err) {
        last = err;
        if (!retryElsewhere(err)) throw err;
      }
    }
    throw last;
  }

  /** Placement: the agent a sandbox lives on; stale or unknown: 503 `agent_unavailable` at once. */
  agentFor(agentId: string): AgentVmApi {
    const lookup = async (): Promise<AgentApi> => {
      const [row] = await this.db.select().from(agents).where(eq(agents.id, agentId));
      if (!row || !isLive(row, this.clock(), this.staleAfterMs)) {
        throw new SandboxdError(
          "agent_unavailable",
          `agent ${agentId} has not reported for over ${this.staleAfterMs / 1000} s; retry later`,
          { details: { agentId, retryAfterSeconds: 5 } },
        );
      }
      return this.client(row);
    };
    return {
      exec: async (v, a) => (await lookup()).exec(v, a),
      execStream: async (v, a, o) => (await lookup()).execStream(v, a, o),
      fork: async (v, n) => (await lookup()).fork(v, n),
      suspend: async (v) => (await lookup()).suspend(v),
      resume: async (v) => (await lookup()).resume(v),
      destroy: async (v, o) => (await lookup()).destroy(v, o),
      openTunnel: async (v, p, pr) => (await lookup()).openTunnel(v, p, pr),
      startProcess: async (v, r) => (await lookup()).startProcess(v, r),
      listProcesses: async (v) => (await lookup()).listProcesses(v),
      processLogs: async (v, n) => (await lookup()).processLogs(v, n),
      followProcess: async (v, n, o) => (await lookup()).followProcess(v, n, o),
      processStdin: async (v, n, i) => (await lookup()).processStdin(v, n, i),
      killProcess: async (v, n) => (await lookup()).killProcess(v, n),
      openPty: async (v, s) => (await lookup()).openPty(v, s),
      files: async (v, f) => (await lookup()).files(v, f),
      listVms: async () => (await lookup()).listVms(),
    };
  }

  // ---- AgentHostApi: calls that name no VM ----------------------------------------------------

  /** Placement: the calls that name no VM, on the live agents of `region`. */
  hostIn(region: string): AgentHostApi {
    return {
      createSandbox: async (t, o) => (await this.place((a) => a.createSandbox(t, o), region)).result,
      execOnce: async (t, a) => (await this.place((h) => h.execOnce(t, a), region)).result,
      buildTemplate: (t, src) => this.buildIn(region, t, src),
      templateStatus: (t) => this.statusIn(region, t),
      deleteTemplate: (t) => this.everyLive(region, (a) => a.deleteTemplate(t)),
      expectWidth: (t, w) => this.everyLive(region, (a) => a.expectWidth(t, w)),
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

  /** Every live agent of the region; fails only if none took it. */
  private async buildIn(region: string, template: TemplateRef, source: TemplateSource): Promise<void> {
    const rows = await this.live(region);
    try {
      if (rows.length === 0) throw noLiveAgent(region);
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

  private async statusIn(region: string, template: TemplateRef): Promise<TemplateBuildStatus> {
    const settled = await Promise.allSettled(
      (await this.live(region)).map((r) => this.client(r).templateStatus(template)),
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

  private async everyLive(region: string, fn: (a: AgentHostApi) => Promise<void>): Promise<void> {
    const settled = await Promise.allSettled((await this.live(region)).map((r) => fn(this.client(r))));
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
