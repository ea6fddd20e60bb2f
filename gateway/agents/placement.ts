/**
 * Where VMs go: the gateway's core asks a `Placement` (on `Deps`) and never looks at which kind of
 * agent it holds. Two implementations: `AgentRouter` (router.ts) places across the agents that
 * heartbeat to this gateway; `FixedPlacement` (below) sends everything to one configured agent
 * (`startGateway({agent})`, and the tests' in-memory stand-in).
 */
import type { AgentApi, AgentCopyApi, AgentHostApi, AgentVmApi } from "../../contracts/agent/api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";

/**
 * What a new VM claims on the agent it goes to: one slot, and these (unset: 0; `diskMib` unset:
 * `memMib`, as a suspend writes the guest's RAM to the agent's disk). `template` is the agent ref
 * the VM starts from: agents that hold it are preferred.
 */
export interface PlacementNeed {
  template?: string;
  /**
   * The tenant the VM is for: its own agents (BYOC) when it has any live, else the operator's.
   * None: an operator's agent only, never a tenant's own.
   */
  tenant?: string;
  vcpus?: number;
  memMib?: number;
  diskMib?: number;
}

/**
 * Every placement names a region: the home region of the tenant it is for (core/regions.ts), so a
 * tenant's VMs and template builds land on agents of that region only, whichever gateway serves
 * the call (docs/regions.md "Rules of regions").
 */
export interface Placement {
  /**
   * The agent of `region` a new VM goes to first, so that its record can name it before the VM
   * exists; its `agents` row exists once this resolves. None live in the region, or none with
   * room: 503 `at_capacity` (`noLiveAgent`).
   */
  firstChoice(region: string, need?: PlacementNeed): Promise<string>;
  /**
   * Runs `fn` (a create) on the first agent of `region` that takes it, moving on to the next when
   * one refuses before starting anything; returns which agent took it. When every agent refused,
   * the last refusal is thrown (no room anywhere reads as `at_capacity`).
   */
  place<T>(
    fn: (api: AgentHostApi) => Promise<T>,
    region: string,
    need?: PlacementNeed,
  ): Promise<{ agentId: string; result: T }>;
  /**
   * The calls that name no VM (template builds, status, deletes), on the agents of `region`; with
   * `tenant`, on those that take its VMs (its own, else the operator's); without, on every one.
   */
  hostIn(region: string, tenant?: string): AgentHostApi;
  /** The calls that name no VM, on agent `agentId` alone (a build it missed); not live: 503. */
  hostOn(agentId: string): AgentHostApi & AgentCopyApi;
  /**
   * The calls on the VMs of the agent with this id (the id on a sandbox's record); one that is not
   * live fails its calls at once.
   */
  agentFor(agentId: string): AgentVmApi;
}

/**
 * 503 `at_capacity`: no live agent in `region`. The same answer as a region whose agents are all
 * full, because a client does the same thing for both: retry with backoff while an operator starts
 * (or enrolls) a host there; `details.region` says which region is empty.
 */
export function noLiveAgent(region: string): SandboxdError {
  return new SandboxdError("at_capacity", `no live agent in region ${region}; retry with backoff`, {
    details: { region, retryAfterSeconds: 5 },
  });
}

/** Every call that names no VM refused with `noLiveAgent(region)`. */
export function emptyRegion(region: string): AgentHostApi & AgentCopyApi {
  const refuse = async (): Promise<never> => {
    throw noLiveAgent(region);
  };
  return {
    createSandbox: refuse,
    execOnce: refuse,
    buildTemplate: refuse,
    templateStatus: refuse,
    deleteTemplate: refuse,
    expectWidth: refuse,
    releaseTemplate: refuse,
    health: refuse,
    exportTemplate: refuse,
    copyTemplate: refuse,
  };
}

/** The agent row must exist before sandboxes reference it; upserted once per process and db. */
const agentRows = new WeakMap<Db, Promise<void>>();

/**
 * One configured agent, named by `config.agent` (id, region, url), takes every VM of its region;
 * a tenant at home in another region finds no live agent there.
 */
export class FixedPlacement implements Placement {
  constructor(
    private readonly db: Db,
    private readonly agent: AgentApi,
    private readonly row: { id: string; region: string; url: string },
  ) {}

  async firstChoice(region: string, _need?: PlacementNeed): Promise<string> {
    if (region !== this.row.region) throw noLiveAgent(region);
    await this.ensureRow();
    return this.row.id;
  }

  async place<T>(
    fn: (api: AgentHostApi) => Promise<T>,
    region: string,
    _need?: PlacementNeed,
  ): Promise<{ agentId: string; result: T }> {
    if (region !== this.row.region) throw noLiveAgent(region);
    return { agentId: this.row.id, result: await fn(this.agent) };
  }

  hostIn(region: string, _tenant?: string): AgentHostApi {
    return region === this.row.region ? this.agent : emptyRegion(region);
  }

  agentFor(_agentId: string): AgentVmApi {
    return this.agent;
  }

  hostOn(agentId: string): AgentHostApi & AgentCopyApi {
    return agentId === this.row.id ? this.agent : emptyRegion(this.row.region);
  }

  private ensureRow(): Promise<void> {
    let p = agentRows.get(this.db);
    if (!p) {
      const { id, region, url } = this.row;
      p = this.db
        .insert(agents)
        .values({ id, region, url })
        .onConflictDoUpdate({ target: agents.id, set: { region, url } })
        .then(() => undefined);
      p.catch(() => agentRows.delete(this.db));
      agentRows.set(this.db, p);
    }
    return p;
  }
}
