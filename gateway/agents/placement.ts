/**
 * Where VMs go: the gateway's core asks a `Placement` (on `Deps`) and never looks at which kind of
 * agent it holds. Two implementations: `AgentRouter` (router.ts) places across the agents that
 * heartbeat to this gateway; `FixedPlacement` (below) sends everything to one configured agent
 * (`startGateway({agent})`, and the tests' in-memory stand-in).
 */
import type { AgentApi, AgentHostApi, AgentVmApi } from "../../contracts/agent/api.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";

/**
 * What a new VM claims on the agent it goes to: one slot, and these (unset: 0; `diskMib` unset:
 * `memMib`, as a suspend writes the guest's RAM to the agent's disk). `template` is the agent ref
 * the VM starts from: agents that hold it are preferred.
 */
export interface PlacementNeed {
  template?: string;
  vcpus?: number;
  memMib?: number;
  diskMib?: number;
}

export interface Placement {
  /**
   * The agent a new VM goes to first, so that its record can name it before the VM exists; its
   * `agents` row exists once this resolves. None with room: 503 `at_capacity`.
   */
  firstChoice(need?: PlacementNeed): Promise<string>;
  /**
   * Runs `fn` (a create) on the first agent that takes it, moving on to the next when one refuses
   * before starting anything; returns which agent took it. When every agent refused, the last
   * refusal is thrown (no room anywhere reads as `at_capacity`).
   */
  place<T>(
    fn: (api: AgentHostApi) => Promise<T>,
    need?: PlacementNeed,
  ): Promise<{ agentId: string; result: T }>;
  /**
   * The calls on the VMs of the agent with this id (the id on a sandbox's record); one that is not
   * live fails its calls at once.
   */
  agentFor(agentId: string): AgentVmApi;
}

/** The agent row must exist before sandboxes reference it; upserted once per process and db. */
const agentRows = new WeakMap<Db, Promise<void>>();

/** One configured agent, named by `config.agent` (id, region, url), takes every VM. */
export class FixedPlacement implements Placement {
  constructor(
    private readonly db: Db,
    private readonly agent: AgentApi,
    private readonly row: { id: string; region: string; url: string },
  ) {}

  async firstChoice(_need?: PlacementNeed): Promise<string> {
    await this.ensureRow();
    return this.row.id;
  }

  async place<T>(
    fn: (api: AgentHostApi) => Promise<T>,
    _need?: PlacementNeed,
  ): Promise<{ agentId: string; result: T }> {
    return { agentId: this.row.id, result: await fn(this.agent) };
  }

  agentFor(_agentId: string): AgentVmApi {
    return this.agent;
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
