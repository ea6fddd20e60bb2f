/**
 * `sandboxd fleet list|cordon|uncordon|drain`: the agents as the gateway sees them, and taking one
 * out of placement (docs/fleet.md "Cordon and drain"). `drain` cordons the agent and waits for its
 * live sandboxes to end (deleted by their owners, reaped by their idle lifetimes, or failed); it
 * suspends and deletes nothing itself. It runs through the service's operator socket when one
 * answers, else on the database directly (cli/operator.ts).
 */
import { parseArgs } from "node:util";
import { SandboxdError } from "../contracts/errors.ts";
import type { FleetAgent } from "../gateway/agents/fleet.ts";
import { parseTtl } from "./agent-tokens.ts";
import { defaultDataDir } from "./config.ts";
import { runOperatorOp } from "./operator.ts";
import { OPERATOR_OPS } from "./operator-ops.ts";

/** How long `drain` waits by default: an hour of an operator at a terminal; a longer drain passes --timeout. */
export const DRAIN_DEFAULT_TIMEOUT_S = 3600;
/** How often `drain` counts: the count is one query; a couple of seconds late is nothing to a drain. */
export const DRAIN_POLL_MS = 2000;

/** The calls a drain makes, over the socket or the database (`runOperatorOp` bound to a data dir). */
export interface FleetCalls {
  list(): Promise<FleetAgent[]>;
  cordon(id: string, on: boolean): Promise<void>;
}

export function fleetCalls(dataDir: string): FleetCalls {
  return {
    list: () => runOperatorOp(dataDir, OPERATOR_OPS, "fleet.list", {}),
    cordon: async (id, on) => {
      await runOperatorOp(dataDir, OPERATOR_OPS, "fleet.cordon", { id, on });
    },
  };
}

/**
 * Cordons agent `id`, then waits until it holds no live sandbox or `timeoutMs` passed. Returns
 * the live sandboxes left (0: drained). `onCount` hears each count that differs from the last.
 */
export async function drainAgent(
  calls: FleetCalls,
  id: string,
  opts: { timeoutMs: number; pollMs: number; onCount?: (n: number) => void; now?: () => number },
): Promise<number> {
  const now = opts.now ?? Date.now;
  await calls.cordon(id, true);
  const deadline = now() + opts.timeoutMs;
  let last = -1;
  for (;;) {
    const agent = (await calls.list()).find((a) => a.id === id);
    if (!agent) throw new SandboxdError("not_found", `no agent ${id}`);
    if (agent.liveSandboxes !== last) opts.onCount?.(agent.liveSandboxes);
    last = agent.liveSandboxes;
    if (last === 0 || now() >= deadline) return last;
    await Bun.sleep(opts.pollMs);
  }
}

export async function cmdFleet(args: string[]): Promise<number> {
  const [sub, ...rest] = args;
  const { values, positionals } = parseArgs({
    args: rest,
    options: { "data-dir": { type: "string" }, timeout: { type: "string" } },
    allowPositionals: true,
  });
  const calls = fleetCalls(values["data-dir"] ?? defaultDataDir());
  const id = positionals[0];
  if (sub === "list") {
    for (const a of await calls.list()) process.stdout.write(`${JSON.stringify(a)}\n`);
    return 0;
  }
  if (!id || (sub !== "cordon" && sub !== "uncordon" && sub !== "drain")) {
    throw new SandboxdError("bad_request", "usage: sandboxd fleet list | cordon|uncordon|drain AGENT-ID");
  }
  if (sub !== "drain") {
    await calls.cordon(id, sub === "cordon");
    process.stdout.write(`${sub === "cordon" ? "cordoned" : "uncordoned"} agent ${id}\n`);
    return 0;
  }
  const timeoutS = values.timeout === undefined ? DRAIN_DEFAULT_TIMEOUT_S : parseTtl(values.timeout);
  const left = await drainAgent(calls, id, {
    timeoutMs: timeoutS * 1000,
    pollMs: DRAIN_POLL_MS,
    onCount: (n) => process.stderr.write(`agent ${id}: cordoned, ${n} live sandboxes\n`),
  });
  if (left === 0) {
    process.stdout.write(`drained agent ${id}: no live sandbox left; it stays cordoned (fleet uncordon)\n`);
    return 0;
  }
  process.stdout.write(
    `agent ${id} still holds ${left} live sandboxes after ${timeoutS} s; it stays cordoned\n`,
  );
  return 1;
}
