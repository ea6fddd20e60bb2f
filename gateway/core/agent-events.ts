/**
 * The agents' reports of their VMs (contracts/agent/events.ts) written into the rows as they
 * arrive: the usage interval follows the VM's metering phase (running, paused by idleness,
 * suspended) from the agent's own timestamp, with the resources it measured; a VM that died
 * ends its row at once (`destroyed`, end_reason `failed`, the agent's reason in `end_detail`), so
 * it stops billing and counting against its tenant's quota; a destroyed VM stops billing.
 *
 * The row's state is the API's (record-states.ts): events change it only to end a VM that died.
 * An event about a VM no live row names (a create not yet recorded, a one-shot exec, a row
 * already ended) changes nothing. Events of one agent are applied in order, each in its own
 * transaction with the row locked, and applying one twice changes nothing, so the agent may
 * send again whatever it is not sure arrived.
 *
 * Times: an interval starts at the agent's timestamp, but never before the open interval it
 * closes (the gateway may have written a later change for the same VM, e.g. the suspend it asked
 * for) nor after the gateway's now (a fast agent clock): intervals never overlap or run ahead.
 */
import { and, eq, isNull, ne } from "drizzle-orm";
import type { VmResources } from "../../contracts/agent/api.ts";
import type { VmEvent } from "../../contracts/agent/events.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import type { Deps } from "../deps.ts";
import { recordChange } from "./record-states.ts";
import { type SandboxRow, switchInterval } from "./sandboxes.ts";
import type { Tx } from "./tenant-lock.ts";

export type EventDeps = Pick<Deps, "db" | "clock" | "relays">;

/** Writes one agent's batch, in order. */
export async function applyAgentEvents(
  deps: EventDeps,
  agentId: string,
  events: readonly VmEvent[],
  log: (line: string) => void,
): Promise<void> {
  for (const e of events) await applyEvent(deps, agentId, e, log);
}

async function applyEvent(
  deps: EventDeps,
  agentId: string,
  e: VmEvent,
  log: (line: string) => void,
): Promise<void> {
  const ended = await deps.db.transaction(async (tx) => {
    const [row] = await tx
      .select()
      .from(sandboxes)
      .where(
        and(eq(sandboxes.agentId, agentId), eq(sandboxes.vmId, e.vmId), ne(sandboxes.state, "destroyed")),
      )
      .for("update");
    if (!row) return undefined;
    const [open] = await tx
      .select()
      .from(usageIntervals)
      .where(and(eq(usageIntervals.sandboxId, row.id), isNull(usageIntervals.endedAt)));
    const at = new Date(Math.min(Math.max(e.atMs, open?.startedAt.getTime() ?? 0), deps.clock()));
    if (e.state === "failed") {
      await endRow(tx, row, at, e.reason ?? "the VM failed on its agent");
      return row;
    }
    // Closed by a destroy: nothing more to meter (a destroy the gateway asked for ends the row
    // itself; any other leaves a row whose VM is gone, which reconciliation ends).
    if (!open) return undefined;
    if (e.state === "destroyed") {
      await switchInterval(tx, row, null, at);
      return undefined;
    }
    if (open.state === e.state && sameResources(open, e.resources)) return undefined;
    const next = { state: e.state, ...e.resources };
    if (at.getTime() === open.startedAt.getTime()) {
      // The interval has not lasted a millisecond yet: it is replaced rather than split.
      await tx.update(usageIntervals).set(next).where(eq(usageIntervals.id, open.id));
    } else {
      await switchInterval(tx, row, next, at);
    }
    if (e.state !== "suspended") {
      await tx.update(sandboxes).set({ diskBytes: e.resources.diskBytes }).where(eq(sandboxes.id, row.id));
    }
    return undefined;
  });
  if (ended) {
    log(`agent ${agentId}: ${ended.id} (${e.vmId}) failed: ${e.reason ?? "no reason given"}`);
    deps.relays?.closeSandbox(ended.id, 1001, "sandbox failed");
  }
}

function sameResources(a: { vcpus: number; memMib: number; diskBytes: number }, b: VmResources): boolean {
  return a.vcpus === b.vcpus && a.memMib === b.memMib && a.diskBytes === b.diskBytes;
}

/**
 * Ends a live row whose VM is gone or failed, at `at`: `destroyed`, end_reason `failed`, `detail`
 * kept; its open usage interval closes at the same instant. False when the row had ended already.
 */
export async function endRow(
  tx: Tx,
  row: Pick<SandboxRow, "id" | "tenantId">,
  at: Date,
  detail: string,
): Promise<boolean> {
  // The table's destroy: from any live state (the VM is gone whatever the row said).
  const ended = recordChange("destroy");
  const done = await tx
    .update(sandboxes)
    .set({ state: ended.state, endReason: "failed", endDetail: detail, destroyedAt: at })
    .where(and(eq(sandboxes.id, row.id), ended.from))
    .returning({ id: sandboxes.id });
  if (done.length === 0) return false;
  await switchInterval(tx, row, null, at);
  return true;
}
