import { rmSync } from "node:fs";
import { createServer, type Server, type Socket } from "node:net";
import { GuestClient } from "./client.ts";
import type { GuestClientOptions } from "./client-types.ts";
import { GuestError } from "./codec.ts";

/**
 * Host test mode: listens on a unix socket that a host-mode agent (`sandboxd-agent --port PATH`)
 * connects to, and hands out one GuestClient per accepted connection. The agent reconnects every
 * 50 ms after a disconnect, as the guest does after a restore.
 */
export class GuestListener {
  private readonly queue: Socket[] = [];
  private readonly waiters: Array<(s: Socket) => void> = [];

  private constructor(
    readonly path: string,
    private readonly server: Server,
  ) {
    server.on("connection", (s: Socket) => {
      const w = this.waiters.shift();
      if (w) w(s);
      else this.queue.push(s);
    });
  }

  static async listen(path: string): Promise<GuestListener> {
    rmSync(path, { force: true }); // a stale socket file from a crashed run
    const server = createServer();
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(path, () => {
        server.off("error", reject);
        resolve();
      });
    });
    return new GuestListener(path, server);
  }

  /** Waits for the agent's next connection and completes HELLO on it. `timeoutMs` (default
   * 10 s) bounds the wait for the connection: a live agent retries every 50 ms. */
  async accept(opts: GuestClientOptions & { timeoutMs?: number } = {}): Promise<GuestClient> {
    const timeoutMs = opts.timeoutMs ?? 10_000;
    let socket = this.queue.shift();
    while (socket?.destroyed) socket = this.queue.shift(); // closed while queued
    if (!socket) {
      socket = await new Promise<Socket>((resolve, reject) => {
        const waiter = (s: Socket) => {
          clearTimeout(timer);
          resolve(s);
        };
        const timer = setTimeout(() => {
          const i = this.waiters.indexOf(waiter);
          if (i >= 0) this.waiters.splice(i, 1);
          reject(
            new GuestError("guest_timeout", `no agent connected to ${this.path} within ${timeoutMs} ms`),
          );
        }, timeoutMs);
        this.waiters.push(waiter);
      });
    }
    return GuestClient.fromSocket(socket, opts);
  }

  async close(): Promise<void> {
    for (const s of this.queue.splice(0)) s.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
    rmSync(this.path, { force: true });
  }
}
