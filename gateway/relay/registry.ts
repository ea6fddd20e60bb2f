/**
 * The connect relays open in this gateway process, by sandbox, so that deleting (or reaping) a
 * sandbox closes them at once (docs/sandboxes.md "Rules of the sandboxes API": deletion revokes its connect tokens; a relay already
 * open on the sandbox ends with it). Per process: with several gateway replicas a relay on another
 * replica ends when the agent tears the VM's tunnels down.
 */

export interface OpenRelay {
  /** Ends the relay: the client's WebSocket closes with `code`, the tunnel is closed. */
  close(code: number, reason: string): void;
}

/**
 * How long a sandbox's relays stay refused after it was closed, ms: covers a connect that passed
 * its checks just before the delete and registers just after it.
 */
const CLOSED_MEMORY_MS = 60_000;

export class RelayRegistry {
  private readonly open = new Map<string, Set<OpenRelay>>();
  private readonly closed = new Map<string, { at: number; code: number; reason: string }>();
  /** Long calls that are not relays (`hold`), per sandbox. */
  private readonly longCalls = new Map<string, number>();
  /** Relay slots held per tenant: reserved before the tunnel is dialled, freed when it ends. */
  private readonly slots = new Map<string, number>();

  constructor(private readonly now: () => number = Date.now) {}

  /**
   * Takes one of the tenant's `max` relay slots, synchronously (two connects racing cannot both
   * take the last one); returns its release (idempotent), or undefined when all are held.
   */
  reserve(tenantId: string, max: number): (() => void) | undefined {
    if ((this.slots.get(tenantId) ?? 0) >= max) return undefined;
    return countIn(this.slots, tenantId);
  }

  /** Relay slots the tenant holds (open relays and connects under way). */
  held(tenantId: string): number {
    return this.slots.get(tenantId) ?? 0;
  }

  /** Registers a relay; returns its removal. A sandbox closed a moment ago closes it at once. */
  add(sandboxId: string, relay: OpenRelay): () => void {
    const ended = this.closed.get(sandboxId);
    if (ended && this.now() - ended.at < CLOSED_MEMORY_MS) {
      relay.close(ended.code, ended.reason);
      return () => {};
    }
    let set = this.open.get(sandboxId);
    if (!set) {
      set = new Set();
      this.open.set(sandboxId, set);
    }
    set.add(relay);
    return () => {
      set.delete(relay);
      if (set.size === 0 && this.open.get(sandboxId) === set) this.open.delete(sandboxId);
    };
  }

  /** Closes every relay of the sandbox and refuses new ones for a while; returns how many. */
  closeSandbox(sandboxId: string, code: number, reason: string): number {
    const t = this.now();
    for (const [id, e] of this.closed) if (t - e.at >= CLOSED_MEMORY_MS) this.closed.delete(id);
    this.closed.set(sandboxId, { at: t, code, reason });
    const set = this.open.get(sandboxId);
    this.open.delete(sandboxId);
    for (const relay of set ?? []) relay.close(code, reason);
    return set?.size ?? 0;
  }

  /**
   * Counts a long call on the sandbox that is not a relay (a file transfer, a followed log, any
   * call counted in flight that may outlast an exec): it is kept fresh like a relay
   * (`sandboxIds`) until the returned release (idempotent).
   */
  hold(sandboxId: string): () => void {
    return countIn(this.longCalls, sandboxId);
  }

  /**
   * The sandboxes with a relay or a long call open in this process: the reaper keeps their rows
   * fresh, so that a call open longer than any exec is not taken for a count left by a dead
   * gateway.
   */
  sandboxIds(): string[] {
    return [...new Set([...this.open.keys(), ...this.longCalls.keys()])];
  }

  /** Relays open on the sandbox (or in all), for tests and metrics. */
  count(sandboxId?: string): number {
    if (sandboxId !== undefined) return this.open.get(sandboxId)?.size ?? 0;
    let n = 0;
    for (const set of this.open.values()) n += set.size;
    return n;
  }
}

/** Adds one to `key`'s count; returns the removal of that one (idempotent; 0 drops the key). */
function countIn(counts: Map<string, number>, key: string): () => void {
  counts.set(key, (counts.get(key) ?? 0) + 1);
  let released = false;
  return () => {
    if (released) return;
    released = true;
    const n = (counts.get(key) ?? 1) - 1;
    if (n <= 0) counts.delete(key);
    else counts.set(key, n);
  };
}
