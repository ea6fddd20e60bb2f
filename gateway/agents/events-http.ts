/**
 * `POST /internal/agents/events` (contracts/agent/events.ts): an agent's batch of VM state
 * changes, authenticated like its heartbeat (registry.ts) and about that agent only. The batch is
 * handed to `apply` (gateway/core/agent-events.ts, wired by server.ts) and answered 200 only once
 * it is written, so an agent that hears anything else sends it again; a database that is down is
 * a 503, which the agent retries like any other refusal.
 */
import { VmEventBatch } from "../../contracts/agent/events.ts";
import { describeError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { jsonAnswer, parseJsonBody } from "./internal-http.ts";
import { authenticateAgentReport, sameAgent } from "./registry.ts";

export async function handleAgentEvents(
  db: Db,
  agentSecret: string,
  request: Request,
  apply: (agentId: string, batch: VmEventBatch) => Promise<void>,
  log: (line: string) => void,
): Promise<Response> {
  const auth = await authenticateAgentReport(db, agentSecret, request, "events");
  if (!auth.ok) return auth.answer;
  const batch = await parseJsonBody(request, VmEventBatch, "events");
  if (!batch.ok) return batch.answer;
  const other = sameAgent(auth.agent, batch.data.id);
  if (other) return other;
  try {
    await apply(auth.agent.id, batch.data);
  } catch (err) {
    log(`events from agent ${auth.agent.id}: not written: ${describeError(err)}`);
    return jsonAnswer(503, {
      code: "db_unavailable",
      message: "the events could not be written; send them again",
    });
  }
  return jsonAnswer(200, { ok: true, applied: batch.data.events.length });
}
