/**
 * Reconciliation: the rows against what the agents really hold, for whatever the agents' events
 * (agent-events.ts) did not say: events dropped by a full queue, a gateway that was down, an
 * agent that restarted and lost VMs, a gateway that died between an agent's answer and its
 * write. Each difference is settled, and logged with its reason:
 * - a live row whose VM the agent does not list, or lists as failed/lost: the row ends `failed`
 *   (end_detail says which) and its usage interval closes;
 * - a VM no live row names (older than the bring-up bound, so not a create still being
 *   recorded; never a one-shot exec's, which ends with its call): the agent destroys it;
 * - a session or sandbox row still `starting` past the bring-up bound: its create never came
 *   back (the gateway died during it, or the answer was lost); the row ends `failed`;
 * - kept snapshots (`reconcileSnapshots`): a `ready` row whose files the agent does not list is
 *   `lost`, a `lost` one it lists is `ready` again, and one no kept row names the agent drops.
 *
 * When: once at gateway start, every RECONCILE_INTERVAL_MS, and for one agent on its first
 * heartbeat after a gap (an agent this process has not heard from, or one that was stale) and
 * when its events say some were dropped. One pass per agent at a time.
 *
 * Rows are read before the agent is asked: a row started after the read names a VM the list may
 * hold and is not judged by it, and a VM made after the list is not in it to be taken for an
 * orphan.
 */
import { and, eq, inArray, isNotNull, lt, ne } from "drizzle-orm";
import type { VmSummary } from "../../contracts/agent/api.ts";
import { describeError } from "../../contracts/errors.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { snapshots } from "../../db/schema/snapshots.ts";
import type { Deps } from "../deps.ts";
import { endRow } from "./agent-events.ts";

export type ReconcileDeps = Pick<Deps, "db" | "clock" | "placement" | "relays">;

/**
 * How long a create may take before its row is taken for lost: the gateway's deadline for a VM
 * operation on an agent (120 s, gateway/agents/client.ts `vmOp`) plus a minute for the agent's
 * answer to be written. A row still `starting` after that has no call left that could finish it.
 */
export const BRINGUP_BOUND_MS = 180_000;
/**
 * The timer: what events missed is found within a minute and a half; a pass is one list call per
 * agent and a read of its live rows.
 */
export const RECONCILE_INTERVAL_MS = 90_000;

/** VM states of an agent that end the row (agent/sandbox/states.ts). */
const DEAD_VM: ReadonlySet<string> = new Set(["failed", "lost"]);
/** VM states that are already on their way out: neither a row nor an orphan is judged by them. */
const ENDING_VM: ReadonlySet<string> = new Set(["destroying", "destroyed"]);

/** Settles agent `agentId`'s VMs against its rows; returns what it settled, as logged. */
export async function reconcileAgent(
  deps: ReconcileDeps,
  agentId: string,
  why: string,
  log: (line: string) => void,
): Promise<string[]> {
  const settled: string[] = [];
  const note = (line: string) => {
    settled.push(line);
    log(`reconcile (${why}): agent ${agentId}: ${line}`);
  };
  const rows = await deps.db
    .select()
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.agentId, agentId),
        inArray(sandboxes.state, ["running", "suspended"]),
        isNotNull(sandboxes.vmId),
      ),
    );
  const agent = deps.placement.agentFor(agentId);
  const vms = await agent.listVms();
  const byId = new Map<string, VmSummary>(vms.map((v) => [v.id, v]));
  for (const row of rows) {
    const vm = byId.get(row.vmId!);
    let detail: string | undefined;
    if (!vm) detail = `its VM ${row.vmId} is not on agent ${agentId}`;
    else if (DEAD_VM.has(vm.state))
      detail = vm.reason ?? `its VM ${row.vmId} is ${vm.state} on agent ${agentId}`;
    if (detail === undefined) continue;
    const ended = await deps.db.transaction((tx) => endRow(tx, row, new Date(deps.clock()), detail));
    if (ended) {
      deps.relays?.closeSandbox(row.id, 1001, "sandbox failed");
      note(`${row.id} failed: ${detail}`);
    }
  }
  await destroyOrphans(deps, agentId, vms, note);
  await reconcileSnapshots(deps, agentId, note);
  return settled;
}

/** VMs on the agent that no live row names, and that no create can still be recording. */
async function destroyOrphans(
  deps: ReconcileDeps,
  agentId: string,
  vms: readonly VmSummary[],
  note: (line: string) => void,
): Promise<void> {
  const candidates = vms.filter((v) => !v.oneShot && !ENDING_VM.has(v.state));
  if (candidates.length === 0) return;
  const named = await deps.db
    .select({ vmId: sandboxes.vmId, state: sandboxes.state })
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.agentId, agentId),
        inArray(
          sandboxes.vmId,
          candidates.map((v) => v.id),
        ),
      ),
    );
  const live = new Set(named.filter((r) => r.state !== "destroyed").map((r) => r.vmId));
  const ended = new Set(named.filter((r) => r.state === "destroyed").map((r) => r.vmId));
  const now = deps.clock();
  const agent = deps.placement.agentFor(agentId);
  for (const vm of candidates) {
    if (live.has(vm.id)) continue;
    // A row that ended names a VM that must not run on; one no row names yet may be a create
    // whose answer is still being written, until the bring-up bound has passed.
    if (!ended.has(vm.id) && vm.createdAtMs > now - BRINGUP_BOUND_MS) continue;
    const why = ended.has(vm.id) ? "its row has ended" : "no row names it";
    try {
      await agent.destroy(vm.id, { force: true });
      note(`destroyed VM ${vm.id} (${vm.state}): ${why}`);
    } catch (err) {
      note(`could not destroy VM ${vm.id} (${why}): ${describeError(err)}`);
    }
  }
}

/**
 * The agent's kept snapshots against their rows (docs/snapshots.md "A lost host", "Files gone
 * from a live host"): one the agent still holds whose row is `lost` (its host was declared lost
 * and came back with its files) is `ready` again; one whose row is deleted or failed, names
 * another agent, or does not exist, the agent drops; a `ready` row of this agent that the agent
 * does not list (its data disk was replaced, its records removed) is `lost`.
 *
 * The `ready` rows are read before the list: a row is marked ready only after the agent kept the
 * snapshot, so one ready before the question and missing from the answer has no files. Every
 * other row is read after the list: a ref the agent lists had its row written (`creating`)
 * before the agent was asked to keep it, so a snapshot being taken is never taken for an orphan.
 */
async function reconcileSnapshots(
  deps: ReconcileDeps,
  agentId: string,
  note: (line: string) => void,
): Promise<void> {
  const agent = deps.placement.agentFor(agentId);
  const ready = await deps.db
    .select({ id: snapshots.id })
    .from(snapshots)
    .where(and(eq(snapshots.agentId, agentId), eq(snapshots.state, "ready")));
  let refs: string[];
  try {
    refs = await agent.listSnapshots();
  } catch (err) {
    // An agent without the route (older than the gateway), or one that failed to answer: its
    // snapshots stay as they are; nothing is judged on no answer.
    note(`could not list kept snapshots: ${describeError(err)}`);
    return;
  }
  const listed = new Set(refs);
  await loseMissing(
    deps,
    agentId,
    ready.map((r) => r.id).filter((id) => !listed.has(id)),
    note,
  );
  if (refs.length === 0) return;
  const rows = await deps.db
    .select({ id: snapshots.id, state: snapshots.state, agentId: snapshots.agentId })
    .from(snapshots)
    .where(inArray(snapshots.id, refs));
  const byId = new Map(rows.map((r) => [r.id, r]));
  for (const ref of refs) {
    const row = byId.get(ref);
    if (row?.agentId === agentId && row.state === "lost") {
      const back = await deps.db
        .update(snapshots)
        .set({ state: "ready", deletedAt: null, error: null })
        .where(and(eq(snapshots.id, ref), eq(snapshots.state, "lost")))
        .returning({ id: snapshots.id });
      if (back.length > 0) {
        note(`snapshot ${ref} ready again: its files are on agent ${agentId}`);
        continue;
      }
    }
    if (row?.agentId === agentId && (row.state === "ready" || row.state === "creating")) continue;
    const [now] = await deps.db
      .select({ state: snapshots.state, agentId: snapshots.agentId })
      .from(snapshots)
      .where(eq(snapshots.id, ref));
    if (now?.agentId === agentId && (now.state === "ready" || now.state === "creating")) continue;
    const why = !now
      ? "no snapshot row names it"
      : now.agentId !== agentId
        ? `its row is on agent ${now.agentId}`
        : `its row is ${now.state}`;
    try {
      await agent.deleteSnapshot(ref);
      note(`dropped kept snapshot ${ref}: ${why}`);
    } catch (err) {
      note(`could not drop kept snapshot ${ref} (${why}): ${describeError(err)}`);
    }
  }
}

/** How a snapshot whose files its live host no longer has is marked (its `error`'s prefix). */
export const FILES_LOST = "files_lost";

/**
 * Marks `ids`, `ready` snapshots of `agentId` that the agent did not list, `lost`: nothing can
 * start from them (a start would fail on the agent), and they no longer count against the cap.
 * Their metering ends now: when the files went is not known, and they were billed as kept until
 * the service could tell. The update is conditional (still `ready`, still on `agentId`): a delete
 * that finished meanwhile keeps its own end. If the files come back (the disk remounted), the next
 * pass that finds them listed makes the row `ready` again (above).
 */
async function loseMissing(
  deps: ReconcileDeps,
  agentId: string,
  ids: string[],
  note: (line: string) => void,
): Promise<void> {
  if (ids.length === 0) return;
  const lost = await deps.db
    .update(snapshots)
    .set({
      state: "lost",
      deletedAt: new Date(deps.clock()),
      error: `${FILES_LOST}: its host, agent ${agentId}, no longer keeps its files (its data disk was replaced or its records removed)`,
    })
    .where(and(inArray(snapshots.id, ids), eq(snapshots.state, "ready"), eq(snapshots.agentId, agentId)))
    .returning({ id: snapshots.id });
  for (const r of lost) note(`snapshot ${r.id} lost: agent ${agentId} no longer lists it`);
}

/** Ends session and sandbox rows still `starting` past the bring-up bound. Returns their ids. */
export async function endStuckStarting(deps: ReconcileDeps, log: (line: string) => void): Promise<string[]> {
  const now = deps.clock();
  const rows = await deps.db
    .select()
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.state, "starting"),
        ne(sandboxes.kind, "exec"), // a one-shot exec's row lives for its call (endStaleExecs)
        lt(sandboxes.createdAt, new Date(now - BRINGUP_BOUND_MS)),
      ),
    );
  const ended: string[] = [];
  for (const row of rows) {
    const detail = `still starting ${Math.round((now - row.createdAt.getTime()) / 1000)} s after its create: the create never came back`;
    if (await deps.db.transaction((tx) => endRow(tx, row, new Date(now), detail))) {
      ended.push(row.id);
      log(`reconcile: ${row.id} failed: ${detail}`);
    }
  }
  return ended;
}

export interface Reconciler {
  /** An agent's heartbeat was accepted; `previousAt`: its heartbeat before this one. */
  onHeartbeat(agentId: string, previousAt: Date | null): void;
  /** An agent's events say it dropped some. */
  onDropped(agentId: string, dropped: number): void;
  /** One whole pass (stuck rows, then every live agent); resolves when done. */
  pass(why: string): Promise<void>;
  stop(): void;
}

/**
 * Runs reconciliation at start, on a timer and when an agent comes back. `liveAgents`: the ids
 * of the agents that heartbeat now; `staleAfterMs`: a heartbeat gap longer than this is a gap.
 */
export function startReconciler(
  deps: ReconcileDeps,
  opts: {
    liveAgents: () => Promise<string[]>;
    staleAfterMs: number;
    intervalMs?: number;
    log: (line: string) => void;
  },
): Reconciler {
  const log = opts.log;
  const inFlight = new Map<string, Promise<void>>();
  const heard = new Set<string>();
  let stopped = false;
  const one = (agentId: string, why: string): Promise<void> => {
    const running = inFlight.get(agentId);
    if (running || stopped) return running ?? Promise.resolve();
    const p = reconcileAgent(deps, agentId, why, log)
      .then(() => undefined)
      .catch((err) => log(`reconcile (${why}): agent ${agentId}: ${describeError(err)}`))
      .finally(() => inFlight.delete(agentId));
    inFlight.set(agentId, p);
    return p;
  };
  const pass = async (why: string): Promise<void> => {
    try {
      await endStuckStarting(deps, log);
      const ids = await opts.liveAgents();
      await Promise.all(ids.map((id) => one(id, why)));
    } catch (err) {
      log(`reconcile (${why}): ${describeError(err)}`);
    }
  };
  void pass("gateway start");
  const timer = setInterval(() => void pass("timer"), opts.intervalMs ?? RECONCILE_INTERVAL_MS);
  timer.unref?.(); // never keeps the gateway process alive
  return {
    onHeartbeat(agentId, previousAt) {
      const gap = previousAt === null || deps.clock() - previousAt.getTime() > opts.staleAfterMs;
      const first = !heard.has(agentId);
      heard.add(agentId);
      if (gap || first) void one(agentId, first ? "first heartbeat" : "heartbeat after a gap");
    },
    onDropped(agentId, dropped) {
      void one(agentId, `agent dropped ${dropped} events`);
    },
    pass,
    stop() {
      stopped = true;
      clearInterval(timer);
    },
  };
}
