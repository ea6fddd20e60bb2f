/**
 * The connect relays open in this gateway process, by sandbox, so that deleting (or reaping) a
 * sandbox closes them at once (spec 4.2: deletion revokes its connect tokens; a relay already
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
  /** Relay slots held per tenant: reserved before the tunnel is dialled, freed when it ends. */
  private readonly slots = new Map<string, number>();

  constructor(private readonly now: () => number = Date.now) {}

  /**
   * Takes one of the tenant's `max` relay slots, synchronously (two connects racing cannot both
   * take the last one); returns its release (idempotent), or undefined when all are held.
   */
  reserve(tenantId: string, max: number): (() => void) | undefined {
    const held = this.slots.get(tenantId) ?? 0;
    if (held >= max) return undefined;
    this.slots.set(tenantId, held + 1);
    let released = false;
    return () => {
      if (released) return;
      released = true;
      const n = (this.slots.get(tenantId) ?? 1) - 1;
      if (n <= 0) this.slots.delete(tenantId);
      else this.slots.set(tenantId, n);
    };
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

  /** The sandboxes with a relay open in this process (the reaper keeps them from idling). */
  sandboxIds(): string[] {
    return [...this.open.keys()];
  }

  /** Relays open on the sandbox (or in all), for tests and metrics. */
  count(sandboxId?: string): number {
    if (sandboxId !== undefined) return this.open.get(sandboxId)?.size ?? 0;
    let n = 0;
    for (const set of this.open.values()) n += set.size;
    return n;
  }
}
