/**
 * The last line of defence of a serving process (`up`, `gateway`, `agent`): Bun, like Node, ends
 * the process on an unhandled rejection or an uncaught exception, so one forgotten `.catch` on a
 * sandbox's background work (a destroy that hits ENOSPC after its QEMU died) would take down
 * every other sandbox and the API. The handlers log the fault, with the sandbox or VM ids it
 * names, and the process keeps serving. Each such path is a bug to fix where it starts; this
 * only keeps one bug from becoming an outage.
 */
import { describeError } from "../contracts/errors.ts";

/** Ids a fault may name: the gateway's public ids and the agent's VM ids. */
const ID_PATTERN = /\b(?:sbx_[a-z0-9]+|sess_[a-z0-9]+|vm-[0-9a-f]{16})\b/g;

/** The sandbox and VM ids an error names in its messages, causes or details. */
export function idsNamedBy(err: unknown): string[] {
  const found = new Set<string>();
  let cur: unknown = err;
  for (let depth = 0; cur !== undefined && cur !== null && depth < 5; depth++) {
    const text =
      cur instanceof Error
        ? `${cur.message} ${safeJson((cur as { details?: unknown }).details)}`
        : typeof cur === "string"
          ? cur
          : safeJson(cur);
    for (const m of text.matchAll(ID_PATTERN)) found.add(m[0]);
    cur = cur instanceof Error ? cur.cause : undefined;
  }
  return [...found];
}

function safeJson(v: unknown): string {
  if (v === undefined) return "";
  try {
    return JSON.stringify(v) ?? "";
  } catch {
    return "";
  }
}

/** One log line for a fault: its kind, the ids it names, the error chain and where it was thrown. */
export function describeFault(kind: "unhandled rejection" | "uncaught exception", err: unknown): string {
  const ids = idsNamedBy(err);
  const where = ids.length > 0 ? ` (${ids.join(", ")})` : "";
  const stack = err instanceof Error && err.stack ? `\n${err.stack}` : "";
  return `${kind}${where}: ${describeError(err)}; still serving${stack}`;
}

/**
 * Installs the process-level handlers; returns a function that removes them (tests, and `up`
 * after it stopped). Several installs each log once per fault.
 */
export function installFaultHandlers(log: (line: string) => void): () => void {
  const onRejection = (reason: unknown) => {
    safeLog(log, describeFault("unhandled rejection", reason));
  };
  const onException = (err: unknown) => {
    safeLog(log, describeFault("uncaught exception", err));
  };
  process.on("unhandledRejection", onRejection);
  process.on("uncaughtException", onException);
  return () => {
    process.off("unhandledRejection", onRejection);
    process.off("uncaughtException", onException);
  };
}

/** A log that throws (a closed stderr) must not turn the handler into a second fault. */
function safeLog(log: (line: string) => void, line: string): void {
  try {
    log(line);
  } catch {
    // nothing left to tell
  }
}
