/**
 * Calls on a live VM: an exec (`execIn`) claims the record first (one exec at a time, busy
 * otherwise); the file and process calls only count themselves in flight (`beginUse`). Each call's
 * start and end are the record's activity, which the idle reaper reads.
 */
import { and, eq, inArray, sql } from "drizzle-orm";
import type { AgentVmApi, ExecAction, ExecResult, ExecStreamOptions } from "../../../contracts/agent/api.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import { sandboxes } from "../../../db/schema/sandboxes.ts";
import type { Principal } from "../../auth/keys.ts";
import type { Deps } from "../../deps.ts";
import { idleDeadlineMs, noteDeadline } from "../deadlines.ts";
import { RECORD_TRANSITIONS } from "../record-states.ts";
import { forgetRows } from "../row-cache.ts";
import { agentOf, getOwned, inTermsOf, requireAllowed, type SandboxRow } from "./records.ts";

/** Runs an exec in a sandbox or session; with `stream`, its output streams (AgentVmApi.execStream). */
export async function execIn(
  deps: Deps,
  p: Principal,
  id: string,
  action: ExecAction,
  stream?: ExecStreamOptions,
): Promise<ExecResult> {
  const row = await claimForExec(deps, p, id);
  let ok = false;
  try {
    const agent = agentOf(deps, row);
    const call = stream ? agent.execStream(row.vmId!, action, stream) : agent.exec(row.vmId!, action);
    const result = await inTermsOf(row, call);
    ok = true;
    return result;
  } finally {
    await endActivity(deps, row, ok);
  }
}

/**
 * An exec's start in one round trip when it can run: the row, owned by the caller and running,
 * counted in flight with its idleness reset by one UPDATE (what `getOwned`, the state check and
 * `beginActivity` do in three steps, which answer every other case: 404, 410, 409).
 */
async function claimForExec(deps: Deps, p: Principal, id: string): Promise<SandboxRow> {
  const [claimed] = await deps.db
    .update(sandboxes)
    .set({ execsInFlight: sql`${sandboxes.execsInFlight} + 1`, lastExecAt: new Date(deps.clock()) })
    .where(
      and(
        eq(sandboxes.id, id),
        eq(sandboxes.tenantId, p.tenantId),
        eq(sandboxes.api, p.api),
        inArray(sandboxes.state, RECORD_TRANSITIONS.exec.from),
      ),
    )
    .returning()
    .finally(() => forgetRows(deps, id));
  if (claimed) return claimed;
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, "exec");
  await beginActivity(deps, p, row, "exec");
  return row;
}

/**
 * Starts a call that uses a live sandbox or session beside its exec (the file API): the same
 * state check as an exec, and counted in flight like one, so no reaper takes the sandbox
 * mid-transfer; `end` (once, idempotent) when the call is over, a download's stream included.
 */
export async function beginUse(
  deps: Deps,
  p: Principal,
  id: string,
): Promise<{ row: SandboxRow; agent: AgentVmApi; end: () => Promise<void> }> {
  const row = await getOwned(deps, p, id);
  const { end } = await beginUseOf(deps, p, row, "exec");
  return { row, agent: agentOf(deps, row), end };
}

/**
 * Counts a call on `row` in flight, through the one compare-and-set every use of a live record
 * takes (`beginActivity`): an exec-like call (files, processes) or a relay (`connect`: connects and
 * terminals). The call is also held in this process's registry (`touchRelayed` keeps its row
 * fresh each reaper pass), so one that outlasts any exec (a long transfer, a followed log) is not
 * taken for a count left by a dead gateway. `end` (once, idempotent) ends both.
 */
export async function beginUseOf(
  deps: Deps,
  p: Principal,
  row: SandboxRow,
  action: "exec" | "connect",
): Promise<{ end: () => Promise<void> }> {
  requireAllowed(row.id, row.state, action);
  await beginActivity(deps, p, row, action);
  const release = deps.relays?.hold(row.id) ?? (() => {});
  let ended: Promise<void> | undefined;
  return {
    end: () => {
      release();
      ended ??= endActivity(deps, row, false);
      return ended;
    },
  };
}

/**
 * Counts a call in flight on the row (an exec, or a fork of it) and resets its idleness, in one
 * compare-and-set on the state just read: a reaper (of any gateway) that claimed the session
 * first wins, and this call then answers as a call on the reclaimed session would (410), without
 * reaching the agent.
 */
export async function beginActivity(
  deps: Deps,
  p: Principal,
  row: SandboxRow,
  action: "exec" | "fork" | "connect",
): Promise<void> {
  const marked = await deps.db
    .update(sandboxes)
    .set({ execsInFlight: sql`${sandboxes.execsInFlight} + 1`, lastExecAt: new Date(deps.clock()) })
    .where(and(eq(sandboxes.id, row.id), eq(sandboxes.state, row.state)))
    .returning({ id: sandboxes.id })
    .finally(() => forgetRows(deps, row.id));
  if (marked.length > 0) return;
  const now = await getOwned(deps, p, row.id); // 410 when reaped, 404 when deleted
  requireAllowed(row.id, now.state, action);
  throw new SandboxdError("conflict", `cannot ${action} ${row.id}: its state changed meanwhile`);
}

/**
 * The call's end resets idleness again (an exec longer than the TTL leaves a whole TTL after
 * it); a successful exec counts in `exec_count`. Its idle deadline goes to this process's
 * deadline timer (the last call's end is what starts the idle lifetime).
 */
export async function endActivity(
  deps: Deps,
  row: Pick<SandboxRow, "id" | "kind" | "api" | "idleTimeoutS">,
  execDone: boolean,
): Promise<void> {
  const id = row.id;
  noteDeadline(deps, idleDeadlineMs(deps, row, deps.clock()));
  if (deps.activity) {
    deps.activity.end(id, new Date(deps.clock()), execDone);
    return;
  }
  await deps.db
    .update(sandboxes)
    .set({
      execsInFlight: sql`greatest(${sandboxes.execsInFlight} - 1, 0)`,
      lastExecAt: new Date(deps.clock()),
      ...(execDone ? { execCount: sql`${sandboxes.execCount} + 1` } : {}),
    })
    .where(eq(sandboxes.id, id))
    .finally(() => forgetRows(deps, id));
}
