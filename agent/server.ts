/**
 * Serves the agent's HTTP API (agent/api/app.ts) for the gateway. The agent runs under Bun (it
 * drives QEMU through node:child_process and node:net, both of which Bun provides).
 */
import type { AgentCredentials } from "../contracts/agent/token.ts";
import { DEFAULT_DRAIN_DELAY_MS, DEFAULT_DRAIN_TIMEOUT_MS, Drain } from "../contracts/drain.ts";
import { createAgentApp } from "./api/app.ts";
import { tunnelWebSocket } from "./api/tunnel-ws.ts";
import type { SandboxManager } from "./sandbox/manager.ts";

export interface AgentServerOptions {
  manager: SandboxManager;
  /** This agent's id and key from enrollment (api/enroll.ts). */
  credentials: AgentCredentials;
  uploadDir: string;
  /** Free disk an upload leaves (`SANDBOXD_DISK_RESERVE_BYTES`); default DEFAULT_DISK_RESERVE_BYTES. */
  diskReserveBytes?: number;
  /** 127.0.0.1 when gateway and agent share a host; a private address when they do not. */
  hostname: string;
  /** 0 picks a free port. */
  port: number;
  version: string;
  log?: (msg: string) => void;
  /** Default `AGENT_IDLE_TIMEOUT_S`. */
  idleTimeoutS?: number;
}

export interface AgentServer {
  url: string;
  stop(): Promise<void>;
  /**
   * The graceful stop (contracts/drain.ts, SIGTERM): `/readyz` 503, the gateway's calls in flight
   * (an exec, a build's upload) waited for, then `stop()`. The VMs keep running: a restarted agent
   * re-adopts them. Answers how many calls were still running when it gave up.
   */
  drainAndStop(o?: { delayMs?: number; timeoutMs?: number }): Promise<number>;
  /** True from the start of `drainAndStop`: its heartbeats then offer no room (no new VMs). */
  readonly draining: boolean;
}

/**
 * Seconds a connection may take to send a request's headers, or stay idle between requests.
 * Once a request's headers are in, its own timeout is lifted (`server.timeout(request, 0)`): an
 * exec request is silent for as long as the command runs (up to the gateway's 600 s exec cap),
 * over Bun's 255 s cap, and the gateway's AgentHttpClient bounds every call with its own deadline.
 */
export const AGENT_IDLE_TIMEOUT_S = 30;

export function startAgentServer(opts: AgentServerOptions): AgentServer {
  const app = createAgentApp({
    manager: opts.manager,
    credentials: opts.credentials,
    uploadDir: opts.uploadDir,
    ...(opts.diskReserveBytes !== undefined ? { diskReserveBytes: opts.diskReserveBytes } : {}),
    version: opts.version,
    log: opts.log,
  });
  const drain = new Drain();
  const server = Bun.serve({
    hostname: opts.hostname,
    port: opts.port,
    idleTimeout: opts.idleTimeoutS ?? AGENT_IDLE_TIMEOUT_S,
    // Template images are streamed to disk by the route; no whole-body buffering limit applies.
    maxRequestBodySize: Number.MAX_SAFE_INTEGER,
    fetch: (request, srv) => {
      srv.timeout(request, 0);
      // Probes first (no token: for the orchestrator), every call in flight counted for a drain.
      return drain.probe(request) ?? drain.track(app.fetch(request, srv));
    },
    // The only WebSocket route: GET /v1/vms/{id}/tunnel (upgraded in app.ts).
    websocket: tunnelWebSocket,
  });
  const stop = async () => {
    await server.stop(true);
  };
  return {
    url: `http://${opts.hostname}:${server.port}`,
    stop,
    get draining() {
      return drain.isDraining;
    },
    drainAndStop: async (o = {}) => {
      const left = await drain.drain({
        delayMs: o.delayMs ?? DEFAULT_DRAIN_DELAY_MS,
        timeoutMs: o.timeoutMs ?? DEFAULT_DRAIN_TIMEOUT_MS,
      });
      await stop();
      return left;
    },
  };
}
