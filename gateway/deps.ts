/** What createApp and the core functions are given (no globals). */

import type { AgentHostApi } from "../contracts/agent/api.ts";
import type { LogFn } from "../contracts/log.ts";
import type { Db } from "../db/client.ts";
import type { Placement } from "./agents/placement.ts";
import type { KeyConnection, KeyConnections } from "./auth/key-connections.ts";
import type { Principal } from "./auth/keys.ts";
import type { GatewayConfig } from "./config.ts";
import type { ActivityWriter } from "./core/activity.ts";
import type { Deadlines } from "./core/deadlines.ts";
import type { RowCache } from "./core/row-cache.ts";
import type { RelayRegistry } from "./relay/registry.ts";
import type { Upgrade } from "./runtime/types.ts";

/** Milliseconds since the epoch; injectable so tests control time (rate limiter, idle, usage). */
export type Clock = () => number;

export interface Deps {
  db: Db;
  /** Calls that name no VM: templates, exec-once, health. */
  agent: AgentHostApi;
  /** Which agent a new VM goes to, and which one a VM lives on (gateway/agents/placement.ts). */
  placement: Placement;
  config: GatewayConfig;
  clock: Clock;
  /** Connect relays open in this process (gateway/relay/), closed when their sandbox goes. */
  relays?: RelayRegistry;
  /**
   * Long-lived connections of this process by the key that opened them (auth/key-connections.ts):
   * revoking the key ends them.
   */
  connections?: KeyConnections;
  /**
   * Where the ends of calls are written behind (core/activity.ts); without it each end is its
   * own UPDATE, as under `createApp` alone in tests.
   */
  activity?: ActivityWriter;
  /**
   * Rows the reads that only show a sandbox may serve from memory (core/row-cache.ts); without it
   * every read goes to the database, as under `createApp` alone in tests. This process's writes
   * drop their rows from it.
   */
  rows?: RowCache;
  /**
   * Where this process's writes say a lifetime's deadline (core/deadlines.ts), so that its deadline
   * timer (core/reaper.ts) acts on it within about a second; without it (tests with no reaper)
   * nothing listens.
   */
  deadlines?: Deadlines;
  /** Where a cleanup that failed on a path already failing is said (default: stderr). */
  log?: LogFn;
}

/**
 * Registers a long-lived connection under the key that opened it (auth/key-connections.ts);
 * returns its removal. Without a registry (`Deps.connections` absent) nothing is held.
 */
export function holdForKey(deps: Pick<Deps, "connections">, keyId: string, conn: KeyConnection): () => void {
  return deps.connections ? deps.connections.add(keyId, conn) : () => {};
}

/** The gateway's log line writer: `deps.log`, else stderr. */
export function logOf(deps: Pick<Deps, "log">): (line: string) => void {
  return deps.log ?? ((line) => console.error(line));
}

/**
 * `upgrade`: given by the server (gateway/server.ts, runtime/) with a request that asks for a
 * WebSocket; absent under `app.request()`.
 */
export type HonoEnv = {
  Variables: { principal: Principal; requestId: string };
  Bindings: { upgrade?: Upgrade };
};
