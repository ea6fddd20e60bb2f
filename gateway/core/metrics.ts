/**
 * A sandbox's live metrics (docs/metrics.md): the caller's own sandbox (another tenant's id is
 * 404, as everywhere), asked of the agent that holds it. Looking is not use: it neither resumes a
 * suspended sandbox nor counts for its idle lifetime, so a console left open on a sandbox does not
 * keep it awake. The figures are the agent's own samples of the VM from the host; the guest has
 * no say in them.
 */
import type { z } from "zod";
import type { VmMetrics } from "../../contracts/agent/api.ts";
import type { SandboxMetrics } from "../../contracts/api/sandboxes-api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { agentOf, getOwned, inTermsOf } from "./sandboxes.ts";

type Answer = z.infer<typeof SandboxMetrics>;
type Sample = Answer["samples"][number];

/** The sampling interval an answer names when the agent gave none (no VM yet): the agent's default. */
const DEFAULT_INTERVAL_S = 2;

export async function sandboxMetrics(deps: Deps, p: Principal, id: string): Promise<Answer> {
  const row = await getOwned(deps, p, id, { cached: true });
  const state = row.state === "suspended" ? "suspended" : row.state === "starting" ? "starting" : "running";
  const none: Answer = { id: row.id, state, interval_s: DEFAULT_INTERVAL_S, current: null, samples: [] };
  if (row.vmId === null) return none;
  let m: VmMetrics;
  try {
    m = await inTermsOf(row, agentOf(deps, row).metrics(row.vmId));
  } catch (err) {
    // A suspended sandbox its agent no longer holds in memory (the agent restarted since) has no
    // samples: said as such, not as an error.
    if (state === "suspended" && err instanceof SandboxdError && err.code === "not_found") return none;
    throw err;
  }
  const samples: Sample[] = m.samples.map((s) => ({
    at: new Date(s.atMs).toISOString(),
    cpu_percent: s.cpuPercent,
    memory_used_bytes: Math.round(s.memUsedBytes),
    memory_resident_bytes: Math.round(s.memResidentBytes),
    disk_used_bytes: Math.round(s.diskBytes),
  }));
  return {
    id: row.id,
    state,
    vcpus: m.vcpus,
    memory_limit_bytes: m.memLimitBytes,
    interval_s: m.intervalMs / 1000,
    current: samples.at(-1) ?? null,
    samples,
  };
}
