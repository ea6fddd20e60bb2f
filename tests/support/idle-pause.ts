/**
 * Seeing a sandbox's idle pause from outside a running `bin/sandboxd up` (tests/e2e/): the public
 * API shows an idle-paused VM as `running`, but its agent reports the pause to the gateway, which
 * meters it (a `paused` usage interval from the agent's own timestamp). The operator's usage read
 * by sandbox (`sandboxd usage --by sandbox`, here through the running service's operator socket)
 * counts an open interval up to now, so a sandbox whose paused seconds grow is paused now.
 *
 * Use: `const mark = await pausedSeconds(...)` right after the sandbox's last call, then
 * `waitForIdlePause(..., mark, ms)`. The figure grows past the mark only when the sandbox was
 * paused at some moment after the mark: a paused interval open at the mark is counted up to the
 * mark, and later up to now or to the wake (the agent's time, never before the call that woke it);
 * one that was closed before the mark no longer changes. Nothing else calls the sandbox meanwhile,
 * so it is still paused when the test's next call wakes it.
 */
import { runOperatorOp } from "../../cli/operator.ts";
import { OPERATOR_OPS } from "../../cli/operator-ops.ts";

/** The paused seconds metered for sandbox (or session) `id` of `tenant` so far; 0 before any. */
export async function pausedSeconds(dataDir: string, tenant: string, id: string): Promise<number> {
  const now = Date.now();
  const lines = (await runOperatorOp(dataDir, OPERATOR_OPS, "usage.read", {
    tenant,
    from: new Date(now - 24 * 3_600_000).toISOString(),
    to: new Date(now + 3_600_000).toISOString(),
    by: "sandbox",
  })) as { sandbox_id?: string; paused_seconds: number }[];
  return lines.find((l) => l.sandbox_id === id)?.paused_seconds ?? 0;
}

/**
 * Polls until sandbox `id` is idle-paused: its paused seconds grew past `mark` (read after its
 * last call). Resolves whether that happened within `timeoutMs`; the caller asserts it.
 */
export async function waitForIdlePause(
  dataDir: string,
  tenant: string,
  id: string,
  mark: number,
  timeoutMs: number,
): Promise<boolean> {
  // Every 250 ms: each look is a usage query on the service's database.
  const deadline = performance.now() + timeoutMs;
  while (performance.now() < deadline) {
    if ((await pausedSeconds(dataDir, tenant, id)) > mark) return true;
    await Bun.sleep(250);
  }
  return (await pausedSeconds(dataDir, tenant, id)) > mark;
}
