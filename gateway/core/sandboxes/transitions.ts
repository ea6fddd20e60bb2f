/**
 * A record's state change: a compare-and-set on its old state (record-states.ts) with its usage
 * interval switched in the same transaction.
 */
import { and, eq } from "drizzle-orm";
import { SandboxdError } from "../../../contracts/errors.ts";
import { sandboxes } from "../../../db/schema/sandboxes.ts";
import type { Deps } from "../../deps.ts";
import { nextState, type RecordChange, type RecordState } from "../record-states.ts";
import { forgetRows } from "../row-cache.ts";
import type { Tx } from "../tenant-lock.ts";
import { type SandboxRow, switchInterval } from "./records.ts";

export async function applyTransition(
  deps: Deps,
  row: SandboxRow,
  action: RecordChange,
  set: Partial<typeof sandboxes.$inferInsert>,
  interval: Parameters<typeof switchInterval>[2],
): Promise<void> {
  const at = new Date(deps.clock());
  try {
    await applyTransitionTx(deps, row, action, set, interval, at);
  } finally {
    forgetRows(deps, row.id);
  }
}

async function applyTransitionTx(
  deps: Deps,
  row: SandboxRow,
  action: RecordChange,
  set: Partial<typeof sandboxes.$inferInsert>,
  interval: Parameters<typeof switchInterval>[2],
  at: Date,
): Promise<void> {
  await deps.db.transaction(async (tx) => {
    const updated = await tx
      .update(sandboxes)
      .set({ ...set, state: nextState(action) })
      .where(and(eq(sandboxes.id, row.id), eq(sandboxes.state, row.state)))
      .returning({ id: sandboxes.id });
    if (updated.length === 0) {
      // The agent's report of the VM's end (core/agent-events.ts) or reconciliation settled the
      // row first: what this destroy wanted is done.
      if (action === "destroy" && (await stateOf(tx, row.id)) === "destroyed") return;
      throw new SandboxdError("conflict", `cannot ${action} ${row.id}: its state changed meanwhile`);
    }
    await switchInterval(tx, row, interval, at);
  });
}

async function stateOf(tx: Tx, id: string): Promise<RecordState | undefined> {
  const [r] = await tx.select({ state: sandboxes.state }).from(sandboxes).where(eq(sandboxes.id, id));
  return r?.state;
}
