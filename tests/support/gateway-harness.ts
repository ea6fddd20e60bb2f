/**
 * Test harness for gateway tests: a real PGlite db in a temp dir (or a Postgres URL), the
 * in-memory stand-in agent (memory-agent.ts), a controllable clock, and helpers to issue keys
 * and make requests through `app.request()`. Every response `req` returns has been checked against
 * openapi.yaml (tests/support/openapi-check.ts) unless `validate: false`: a mismatch rejects.
 */

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { AgentHostApi } from "../../contracts/agent/api.ts";
import type { Limits } from "../../contracts/api/limits.ts";
import type { Tier } from "../../contracts/api/tiers.ts";
import type { LogFn } from "../../contracts/log.ts";
import { type DbHandle, openDb } from "../../db/client.ts";
import type { Placement } from "../../gateway/agents/placement.ts";
import { createApp } from "../../gateway/app.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { resolveConfig } from "../../gateway/config.ts";
import type { Deadlines } from "../../gateway/core/deadlines.ts";
import type { RowCache } from "../../gateway/core/row-cache.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { MemoryAgent } from "./memory-agent.ts";
import { assertFetchResponse } from "./openapi-check.ts";

export const PEPPER = "test-pepper-0123456789";

export interface Harness {
  app: ReturnType<typeof createApp>;
  handle: DbHandle;
  agent: MemoryAgent;
  config: ReturnType<typeof resolveConfig>;
  dir: string;
  now: { ms: number };
  /** A new key of `tenant` (made at home in `region` if new; no region: the gateway's). */
  key(tenant: string, tier: Tier, region?: string): Promise<string>;
  req(
    method: string,
    path: string,
    opts?: { key?: string; json?: unknown; body?: RequestInit["body"]; headers?: Record<string, string> },
  ): Promise<Response>;
  close(): Promise<void>;
}

export async function makeHarness(
  opts: {
    url?: string;
    limits?: Partial<Limits>;
    validate?: boolean;
    /** A row cache for the app (core/row-cache.ts); the test drives its LISTEN state. */
    rows?: RowCache;
    /** How long a build or create waits for an agent (gateway/config.ts AGENT_WAIT_MS). */
    agentWaitMs?: number;
    /**
     * A placement over many agents (e.g. an `AgentRouter` over in-memory agents) instead of the
     * one `agent`, made with the harness's db and clock; it also serves the calls that name no VM.
     */
    placement?: (db: DbHandle["db"], clock: () => number) => Placement & AgentHostApi;
    /** The gateway's default region (`config.region`). */
    region?: string;
    /** The app's log lines with their fields (default: dropped). */
    log?: LogFn;
    /** The wall clock instead of the stepped `now` (timers that must fire: the deadline timer). */
    realClock?: boolean;
    /** Where the app's writes say their deadlines (core/deadlines.ts), for a reaper the test starts. */
    deadlines?: Deadlines;
  } = {},
): Promise<Harness> {
  const dir = mkdtempSync(join(tmpdir(), "sandboxd-gw-"));
  const handle = await openDb(opts.url !== undefined ? { url: opts.url } : { dataDir: dir });
  const agent = new MemoryAgent();
  const now = { ms: Date.parse("2025-03-01T12:00:00Z") };
  const clock = opts.realClock ? Date.now : () => now.ms;
  agent.clock = clock;
  const config = resolveConfig({
    keyPepper: PEPPER,
    connectSecret: "test-connect-secret-0123",
    uploadDir: join(dir, "uploads"),
    publicBaseUrl: "https://api.example.test",
    version: "test-1",
    ...(opts.limits ? { limits: opts.limits } : {}),
    ...(opts.agentWaitMs !== undefined ? { agentWaitMs: opts.agentWaitMs } : {}),
    ...(opts.region !== undefined ? { region: opts.region } : {}),
  });
  await upsertPublicTemplate(
    { db: handle.db, clock },
    { id: "python", name: "Python 3", description: "CPython 3.12" },
  );
  agent.addReadyTemplate("python");
  const placement = opts.placement?.(handle.db, clock);
  const app = createApp({
    db: handle.db,
    ...(placement ? { agent: placement, placement } : { agent }),
    config,
    clock,
    log: opts.log ?? (() => {}),
    ...(opts.rows ? { rows: opts.rows } : {}),
    ...(opts.deadlines ? { deadlines: opts.deadlines } : {}),
  });
  return {
    app,
    handle,
    agent,
    config,
    dir,
    now,
    key: async (tenant, tier, region) =>
      (await createKey(handle.db, PEPPER, { tenant, tier, ...(region !== undefined ? { region } : {}) })).key,
    req: (method, path, o = {}) => {
      const headers: Record<string, string> = { ...o.headers };
      if (o.key !== undefined) headers.authorization = `Bearer ${o.key}`;
      let body: RequestInit["body"] | undefined = o.body;
      if (o.json !== undefined) {
        body = JSON.stringify(o.json);
        headers["content-type"] = "application/json";
      }
      const init: RequestInit = { method, headers };
      if (body !== undefined) init.body = body;
      return Promise.resolve(app.request(path, init)).then(async (res) => {
        if (opts.validate !== false) await assertFetchResponse(method, path, res);
        return res;
      });
    },
    close: async () => {
      await handle.close();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
