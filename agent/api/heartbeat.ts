/**
 * The agent's side of the heartbeat (contracts/agent/heartbeat.ts): reports this agent's id,
 * region, advertised URL and capacity to the gateway now and every interval, signed with the key
 * this agent got at enrollment (enroll.ts). A failed beat is
 * logged and retried on the next tick (the gateway may be restarting).
 */
import type { AgentCapacity } from "../../contracts/agent/api.ts";
import { HEARTBEAT_INTERVAL_MS, HEARTBEAT_PATH, type Heartbeat } from "../../contracts/agent/heartbeat.ts";
import { type AgentCredentials, secretKey, signHeartbeatToken } from "../../contracts/agent/token.ts";
import { freeBytesSync } from "../../contracts/disk-space.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";

export interface HeartbeatSender {
  /** Resolves after the first heartbeat was accepted (rejects if it was not). */
  first: Promise<void>;
  /**
   * Sends a beat within KICK_DELAY_MS, besides the interval's: the agent's room changed (a VM
   * ended). Placement counts the room every gateway claimed since the last beat, and a VM that
   * ended since then frees nothing until a beat says so: without this, a burst of creates and
   * deletes meets 503 `at_capacity` on a host with room, for up to an interval.
   */
  soon(): void;
  stop(): void;
}

/** Kicks within this much of each other are one beat: a burst of deletes costs one request. */
const KICK_DELAY_MS = 50;

export function startHeartbeats(opts: {
  gatewayUrl: string;
  credentials: AgentCredentials;
  region: string;
  /** The URL the gateway reaches this agent at. */
  advertiseUrl: string;
  capacity: () => AgentCapacity;
  /** Refs of the templates ready here, reported so that placement prefers this agent for them. */
  templates?: () => string[];
  /** Free disk is reported for this dir (the state dir, where VMs' disks and RAM files go), less `diskReserveBytes`. */
  disk?: { dir: string; reserveBytes: number };
  intervalMs?: number;
  log?: (m: string) => void;
}): HeartbeatSender {
  const key = secretKey(opts.credentials.key);
  const id = opts.credentials.id;
  const url = `${opts.gatewayUrl.replace(/\/+$/, "")}${HEARTBEAT_PATH}`;
  const beat = async (): Promise<void> => {
    const body: Heartbeat = {
      id,
      region: opts.region,
      url: opts.advertiseUrl,
      capacity: { ...opts.capacity(), ...(opts.disk ? { diskMibFree: diskMibFree(opts.disk) } : {}) },
      ...(opts.templates ? { templates: opts.templates().slice(0, MAX_REPORTED_TEMPLATES) } : {}),
    };
    const res = await fetch(url, {
      method: "POST",
      headers: {
        authorization: `Bearer ${await signHeartbeatToken(key, id)}`,
        "content-type": "application/json",
      },
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(HEARTBEAT_INTERVAL_MS),
    });
    if (!res.ok) throw new SandboxdError("internal", `heartbeat refused: ${res.status} ${await res.text()}`);
  };
  const first = beat();
  first.catch((err) => opts.log?.(`heartbeat: ${describeError(err)}`));
  let busy = false;
  // A kick while a beat is in flight is owed one more beat after it: the one in flight may have
  // read the capacity before the change.
  let owed = false;
  let kick: ReturnType<typeof setTimeout> | undefined;
  const tick = (): void => {
    if (busy) {
      owed = true;
      return;
    }
    busy = true;
    owed = false;
    beat()
      .catch((err) => opts.log?.(`heartbeat: ${describeError(err)}`))
      .finally(() => {
        busy = false;
        if (owed && !stopped) tick();
      });
  };
  let stopped = false;
  const timer = setInterval(tick, opts.intervalMs ?? HEARTBEAT_INTERVAL_MS);
  return {
    first,
    soon: () => {
      if (stopped || kick) return;
      kick = setTimeout(() => {
        kick = undefined;
        tick();
      }, KICK_DELAY_MS);
    },
    stop: () => {
      stopped = true;
      clearInterval(timer);
      if (kick) clearTimeout(kick);
    },
  };
}

/**
 * Whether a VM's event frees room on this agent (it ended, or its QEMU went with a suspend): a
 * beat then tells placement at once (`HeartbeatSender.soon`).
 */
export function roomChanged(e: { state: string }): boolean {
  return e.state === "destroyed" || e.state === "failed" || e.state === "suspended";
}

/** The heartbeat contract's bound on reported templates; more are left out (none preferred for those). */
const MAX_REPORTED_TEMPLATES = 4096;

/** Free MiB under `dir` for unprivileged writers, less the reserve the agent keeps for uploads. */
function diskMibFree(disk: { dir: string; reserveBytes: number }): number {
  return Math.max(0, Math.floor((freeBytesSync(disk.dir) - disk.reserveBytes) / 2 ** 20));
}
