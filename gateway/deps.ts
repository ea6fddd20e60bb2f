/** What createApp and the core functions are given (no globals). */

import type { Db } from "../db/client.ts";
import type { AgentApi } from "./agent-api.ts";
import type { GatewayConfig } from "./config.ts";
import type { Principal } from "./keys.ts";

/** Milliseconds since the epoch; injectable so tests control time (rate limiter, idle, usage). */
export type Clock = () => number;

export interface Deps {
  db: Db;
  agent: AgentApi;
  config: GatewayConfig;
  clock: Clock;
}

export type HonoEnv = { Variables: { principal: Principal } };
