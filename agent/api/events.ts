/**
 * The agent's side of the VM events (contracts/agent/events.ts): the manager's meter hands each
 * state change to `push` as it happens; the reporter numbers it, queues it and sends the queue
 * to the gateway at once, in order, in batches of at most MAX_EVENTS_PER_BATCH, signed with this
 * agent's key. A refused or unanswered batch is sent again (the same events, the same order)
 * after a backoff, so the gateway sees every event at least once; applying one twice changes
 * nothing there. Events pushed before `start` (a restarted agent re-adopting its VMs before it
 * knows its gateway) wait in the queue.
 *
 * The queue is bounded (MAX_QUEUED_EVENTS): while the gateway is down VMs keep pausing and waking,
 * and an agent must not grow without limit on a host that runs untrusted code. When it is full
 * the oldest event goes and the next batch says how many went (`dropped`); the gateway then
 * reconciles this agent's VMs with its rows, which restores every state, losing only the exact
 * time of the changes that were dropped.
 */
import {
  AGENT_EVENTS_PATH,
  MAX_EVENTS_PER_BATCH,
  type VmEvent,
  type VmEventBatch,
} from "../../contracts/agent/events.ts";
import { type AgentCredentials, secretKey, signHeartbeatToken } from "../../contracts/agent/token.ts";
import { bestEffort, settled } from "../../contracts/best-effort.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import type { MeterEvent } from "../sandbox/accounting.ts";

/**
 * 4,096 events (~1 MB): a minute of a full host (64 VMs) pausing and waking every second, or hours
 * of ordinary traffic; beyond it reconciliation is cheaper than the backlog.
 */
export const MAX_QUEUED_EVENTS = 4096;
/** First retry after a failed batch; doubled per failure up to RETRY_MAX_MS. */
const RETRY_FIRST_MS = 500;
/** A gateway that is down is asked again at least this often (its restart is noticed within it). */
const RETRY_MAX_MS = 10_000;
/** One batch's request: a gateway that does not answer within it is tried again later. */
const SEND_TIMEOUT_MS = 10_000;

export interface EventTarget {
  gatewayUrl: string;
  credentials: AgentCredentials;
}

export class EventReporter {
  private readonly queue: VmEvent[] = [];
  private seq = 0;
  private dropped = 0;
  private target: { url: string; id: string; key: Uint8Array } | undefined;
  private sending: Promise<void> | undefined;
  private retry: ReturnType<typeof setTimeout> | undefined;
  private backoffMs = RETRY_FIRST_MS;
  private stopped = false;
  private readonly log: (m: string) => void;
  private readonly maxQueued: number;

  constructor(opts: { log?: (m: string) => void; maxQueued?: number } = {}) {
    this.log = opts.log ?? (() => {});
    this.maxQueued = opts.maxQueued ?? MAX_QUEUED_EVENTS;
  }

  /** Where events go from now on; what is queued is sent at once. */
  start(target: EventTarget): void {
    this.target = {
      url: `${target.gatewayUrl.replace(/\/+$/, "")}${AGENT_EVENTS_PATH}`,
      id: target.credentials.id,
      key: secretKey(target.credentials.key),
    };
    this.kick();
  }

  /** Called with each event pushed (the heartbeat's kick when a VM's end frees room). */
  onPush: ((e: MeterEvent) => void) | undefined;

  push(e: MeterEvent): void {
    if (this.stopped) return;
    this.onPush?.(e);
    this.queue.push({ ...e, seq: this.seq++ });
    if (this.queue.length > this.maxQueued) {
      this.queue.shift();
      if (this.dropped++ === 0) this.log(`events: queue full (${this.maxQueued}); dropping the oldest`);
    }
    this.kick();
  }

  /** Events waiting to be accepted. */
  get pending(): number {
    return this.queue.length;
  }

  /**
   * Stops sending: no new batch starts; what is queued gets one last try (the batch in flight
   * first), all within `deadlineMs`, so an agent's exit is not held up by a gateway that is gone.
   */
  async stop(deadlineMs = 2_000): Promise<void> {
    this.stopped = true;
    clearTimeout(this.retry);
    const last = (async () => {
      await this.sending;
      if (this.target && this.queue.length > 0)
        await bestEffort(this.log, "sending the last events", () => this.sendAll());
    })();
    let timer: ReturnType<typeof setTimeout> | undefined;
    await Promise.race([last, new Promise((done) => (timer = setTimeout(done, deadlineMs)))]);
    clearTimeout(timer);
  }

  private kick(): void {
    if (!this.target || this.sending || this.retry || this.stopped) return;
    this.sending = this.sendAll()
      .then(() => {
        this.backoffMs = RETRY_FIRST_MS;
      })
      .catch((err) => {
        this.log(
          `events: ${this.queue.length} not delivered, retry in ${this.backoffMs} ms: ${describeError(err)}`,
        );
        this.retry = setTimeout(() => {
          this.retry = undefined;
          this.kick();
        }, this.backoffMs);
        this.retry.unref?.();
        this.backoffMs = Math.min(this.backoffMs * 2, RETRY_MAX_MS);
      })
      .finally(() => {
        this.sending = undefined;
        // Pushed while the last batch was in flight.
        if (this.queue.length > 0) this.kick();
      });
  }

  private async sendAll(): Promise<void> {
    const t = this.target;
    if (!t) return;
    while (this.queue.length > 0) {
      const events = this.queue.slice(0, MAX_EVENTS_PER_BATCH);
      const dropped = this.dropped;
      const body: VmEventBatch = { id: t.id, events, dropped };
      const res = await fetch(t.url, {
        method: "POST",
        headers: {
          authorization: `Bearer ${await signHeartbeatToken(t.key, t.id)}`,
          "content-type": "application/json",
        },
        body: JSON.stringify(body),
        signal: AbortSignal.timeout(SEND_TIMEOUT_MS),
      });
      if (!res.ok) throw new SandboxdError("internal", `events refused: ${res.status} ${await res.text()}`);
      await settled(res.body?.cancel()); // the answer's status is all that is read
      // Only what was sent leaves; events pushed meanwhile, or dropped, are accounted by seq.
      const last = events.at(-1)!.seq;
      while (this.queue.length > 0 && this.queue[0]!.seq <= last) this.queue.shift();
      this.dropped -= dropped;
    }
  }
}
