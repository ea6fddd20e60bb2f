/**
 * What an agent tells the gateway about its VMs as it happens: `POST /internal/agents/events`,
 * a batch of state changes in the order they happened on the agent, signed like the heartbeat
 * (heartbeat.ts, token.ts: the one agent -> gateway token, naming the agent). The gateway writes
 * them into its rows and usage intervals at the agent's timestamps (gateway/core/agent-events.ts);
 * the agent's sender is agent/api/events.ts.
 *
 * A VM's metering phase changing (running <-> paused by idleness, suspended, resumed), its QEMU
 * dying (`failed`, with the reason), and its end (`destroyed`) are events; so is a measured change
 * of what it holds (`resources`, e.g. its disk overlay grew) while its phase stays the same.
 * Delivery is at least once and in order per agent; applying an event twice changes nothing.
 * Events lost to the agent's bounded queue are counted (`dropped`): the gateway then reconciles
 * that agent's VMs against its rows (gateway/core/reconcile.ts) instead of trusting the gap.
 */
import { z } from "zod";
import { AgentId } from "./enroll.ts";
import { ResourcesSchema, VmIdParam } from "./schemas.ts";

/** Outside the public /v1 API, beside the heartbeat. */
export const AGENT_EVENTS_PATH = "/internal/agents/events";

/**
 * Events per request: a burst (a fork of 64, a host-wide idle pause) fits in one or two requests,
 * and a request stays a few tens of KB, well under any body limit in between.
 */
export const MAX_EVENTS_PER_BATCH = 256;

export const VmEventState = z.enum(["running", "paused", "suspended", "failed", "destroyed"]);
export type VmEventState = z.infer<typeof VmEventState>;

export const VmEvent = z.object({
  /** Per agent process, increasing: the order the agent saw them in (for logs and checks). */
  seq: z.int().min(0),
  vmId: VmIdParam,
  /** The VM's state from `atMs` on; `failed` and `destroyed` end it. */
  state: VmEventState,
  /** The agent's clock, Unix ms: when the change happened, not when it was sent. */
  atMs: z.number().int().min(0),
  /** Why it failed (`failed` only), e.g. `QEMU exited (signal SIGKILL)`. */
  reason: z.string().max(2000).optional(),
  /**
   * What the VM holds from `atMs` on, measured: vCPUs and RAM while it has a QEMU (0 when
   * suspended), disk bytes of its overlay (plus the memory image when suspended).
   */
  resources: ResourcesSchema,
});
export type VmEvent = z.infer<typeof VmEvent>;

export const VmEventBatch = z.object({
  id: AgentId,
  events: z.array(VmEvent).max(MAX_EVENTS_PER_BATCH),
  /** Events the agent had to drop (its queue was full) since its last accepted batch. */
  dropped: z.int().min(0).default(0),
});
export type VmEventBatch = z.infer<typeof VmEventBatch>;
