/**
 * The serving processes' log lines (docs/operations.md "Logs"): plain text by default
 * (`sandboxd: <text>`), or one JSON object per line with `SANDBOXD_LOG_FORMAT=json`:
 * `{"time", "level", "msg", ...fields}` where fields name what the line is about (`request_id`,
 * `tenant`, `sandbox`, `agent`, ...). A writer passes fields where it has them; callers that
 * pass none keep working. A line written while a request is served names that request
 * (`withRequestFields`: its id, trace, tenant, sandbox) without its writer passing them.
 */
import { currentScope } from "./trace.ts";
export type LogFields = Record<string, string | number | boolean | undefined>;
export type LogFn = (line: string, fields?: LogFields) => void;

export type LogFormat = "text" | "json";
export const LOG_FORMATS: readonly LogFormat[] = ["text", "json"];

/**
 * A line's level when its writer named none: `warn` for a WARNING, `error` for a failure or a
 * refusal of our own, `info` otherwise. A heuristic over the words our lines use, so that a JSON
 * reader can filter; a writer that knows better passes `level`.
 */
export function levelOf(line: string): "info" | "warn" | "error" {
  if (/^WARNING\b/.test(line)) return "warn";
  if (/\b(failed|cannot|refused|crashed|unhandled)\b/i.test(line)) return "error";
  return "info";
}

/**
 * The text of one log line in `format`, or undefined when the line is not written in it (an
 * access line, `kind: "access"`, is for JSON logs only: one per request would drown text logs).
 */
export function formatLogLine(
  format: LogFormat,
  line: string,
  fields: LogFields = {},
  now: Date = new Date(),
): string | undefined {
  if (format === "text") return fields.kind === "access" ? undefined : `sandboxd: ${line}`;
  const out: Record<string, unknown> = {
    time: now.toISOString(),
    level: fields.level ?? levelOf(line),
    msg: line,
  };
  for (const [k, v] of Object.entries(fields)) if (v !== undefined && k !== "level") out[k] = v;
  return JSON.stringify(out);
}

/** `fields` with what the request being served (contracts/trace.ts) knows, where not given. */
export function withRequestFields(fields: LogFields = {}): LogFields {
  const scope = currentScope();
  if (!scope) return fields;
  return {
    request_id: scope.requestId,
    trace_id: scope.span?.traceId,
    tenant: scope.tenant,
    sandbox: scope.sandbox,
    agent: scope.agent,
    ...Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined)),
  };
}
