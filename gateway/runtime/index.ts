/**
 * Picks the adapter for the runtime this process runs on. Adapters are imported lazily so that
 * no runtime loads another's code (Node and Deno never load the Bun adapter, Bun never loads
 * @hono/node-server; Deno serves through its node:http, deno.ts).
 */
import type { RunningServer, RuntimeName, ServeOptions } from "./types.ts";

export type { FetchHandler, RunningServer, RuntimeName, ServeOptions } from "./types.ts";

export function detectRuntime(): RuntimeName {
  const g = globalThis as { Bun?: unknown; Deno?: unknown };
  if (g.Bun !== undefined) return "bun";
  if (g.Deno !== undefined) return "deno";
  return "node";
}

export async function serveFetch(opts: ServeOptions, runtime = detectRuntime()): Promise<RunningServer> {
  switch (runtime) {
    case "bun":
      return (await import("./bun.ts")).serveBun(opts);
    case "deno":
      return (await import("./deno.ts")).serveDeno(opts);
    case "node":
      return (await import("./node.ts")).serveNode(opts);
  }
}
