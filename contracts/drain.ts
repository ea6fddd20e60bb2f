/**
 * A serving process's readiness and its graceful stop (docs/operations.md "Probes and graceful
 * stop"), one piece for the gateway and the agent:
 *
 * - `GET /livez`: 200 while the process serves requests at all (an orchestrator restarts it
 *   otherwise). `GET /readyz`: 200 while it should be sent new work, 503 once it is draining or
 *   its own check fails (the gateway: its database). Neither needs credentials nor says more than
 *   its status word: they are for load balancers and kubelets.
 * - `drain()`, on SIGTERM: readiness goes 503 at once; after `delayMs` (the time a load balancer
 *   takes to see it and stop sending) the process waits until the requests in flight have ended
 *   or `timeoutMs` has passed, then the caller stops the server. Requests that arrive meanwhile
 *   are still served: a balancer that has not looked yet is not punished for it.
 *
 * What counts as in flight is each request until its handler answers (an exec answers when the
 * command has ended); a streamed body (SSE, a followed process) is bounded by `timeoutMs`.
 */

/** Between SIGTERM and the wait for requests: a readiness probe every 1-2 s notices within this. */
export const DEFAULT_DRAIN_DELAY_MS = 2_000;
/**
 * The longest a stop waits for requests in flight: a minute covers a long exec's typical tail;
 * Kubernetes' default grace period is 30 s, which a pod spec raises to match (docs/operations.md).
 */
export const DEFAULT_DRAIN_TIMEOUT_MS = 60_000;

export const LIVEZ_PATH = "/livez";
export const READYZ_PATH = "/readyz";

export class Drain {
  private inFlight = 0;
  private draining = false;
  private idle: (() => void) | undefined;

  get isDraining(): boolean {
    return this.draining;
  }

  /** Requests being answered now. */
  get active(): number {
    return this.inFlight;
  }

  /** Counts `answer` in flight until it settles; returns it unchanged. */
  track<T>(answer: T | Promise<T>): T | Promise<T> {
    if (!(answer instanceof Promise)) return answer;
    this.inFlight++;
    const done = () => {
      this.inFlight--;
      if (this.inFlight === 0) this.idle?.();
    };
    answer.then(done, done);
    return answer;
  }

  /**
   * Marks the process draining, waits `delayMs`, then until nothing is in flight or `timeoutMs`;
   * answers how many requests were still running when it gave up (0: all ended).
   */
  async drain(o: { delayMs: number; timeoutMs: number }): Promise<number> {
    this.draining = true;
    await new Promise((r) => setTimeout(r, o.delayMs));
    if (this.inFlight === 0) return 0;
    await new Promise<void>((resolve) => {
      const timer = setTimeout(resolve, o.timeoutMs);
      this.idle = () => {
        clearTimeout(timer);
        resolve();
      };
    });
    this.idle = undefined;
    return this.inFlight;
  }

  /**
   * The probes' answer for `request`, or undefined when it is not a probe. `ready` is the
   * process's own check (true when it has none).
   */
  probe(request: Request, ready: () => Promise<boolean> = async () => true): Promise<Response> | undefined {
    if (request.method !== "GET" && request.method !== "HEAD") return undefined;
    const path = new URL(request.url).pathname;
    if (path === LIVEZ_PATH) return Promise.resolve(probeAnswer(200, "ok"));
    if (path !== READYZ_PATH) return undefined;
    if (this.draining) return Promise.resolve(probeAnswer(503, "draining"));
    return ready().then(
      (ok) => probeAnswer(ok ? 200 : 503, ok ? "ready" : "not_ready"),
      () => probeAnswer(503, "not_ready"),
    );
  }
}

function probeAnswer(status: number, word: string): Response {
  return new Response(JSON.stringify({ status: word }), {
    status,
    headers: { "content-type": "application/json", "cache-control": "no-store" },
  });
}
