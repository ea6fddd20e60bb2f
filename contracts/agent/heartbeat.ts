/**
 * The one call an agent makes to the gateway: `POST /internal/agents/heartbeat`, every
 * HEARTBEAT_INTERVAL_MS, with a heartbeat token (token.ts). Agents report to the gateway over HTTP
 * rather than write the database themselves: the default database is PGlite, which one process
 * (the gateway) owns, and an agent host runs untrusted code, so it should hold no database
 * credentials. The first heartbeat of an agent registers it (gateway/agents/registry.ts); the
 * agent's sender is agent/api/heartbeat.ts.
 */
import { z } from "zod";
import { AgentId, RegionName } from "./enroll.ts";

/** Outside the public /v1 API. */
export const HEARTBEAT_PATH = "/internal/agents/heartbeat";
/** How often an agent reports: capacity shown to placement is at most this old (plus a hop). */
export const HEARTBEAT_INTERVAL_MS = 5_000;

export const Heartbeat = z.object({
  id: AgentId,
  /**
   * The region the agent was started in. The gateway keeps the one its enrollment token named and
   * refuses a heartbeat that names another (gateway/agents/registry.ts).
   */
  region: RegionName,
  /**
   * The URL the gateway reaches this agent at; refused when its enrollment pinned another
   * (`sandboxd agent-token create --url`).
   */
  url: z.string().url(),
  capacity: z.object({
    slotsFree: z.number().int().min(0),
    slotsTotal: z.number().int().min(0),
    vcpusFree: z.number().int().min(0),
    memMibFree: z.number().int().min(0),
    /** Free disk under the agent's state dir, MiB; absent from older agents (no disk check then). */
    diskMibFree: z.number().int().min(0).optional(),
  }),
  /**
   * Refs of the templates ready on this agent, which placement prefers (gateway/agents/router.ts).
   * At most 4096: a host holds far fewer (each is a disk image and a RAM file on its disk), and
   * the bound keeps a beat small. Absent from older agents: then none is preferred.
   */
  templates: z.array(z.string().min(1).max(256)).max(4096).optional(),
});
export type Heartbeat = z.infer<typeof Heartbeat>;
