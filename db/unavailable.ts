/**
 * Whether an error means "the database cannot be reached right now" (as opposed to a bad query):
 * the gateway answers those with 503 `db_unavailable` and `Retry-After`, and health says
 * `degraded`. postgres.js reports a refused or dropped connection by a node errno or its own
 * `CONNECTION_*`/`CONNECT_TIMEOUT` codes; the server reports shutdown and overload by SQLSTATE
 * (class 08 connection exception, 57P01-57P03 shutdown/starting up, 53300 too many connections).
 * drizzle wraps the driver's error as `cause`, so the whole chain is searched.
 */

const NETWORK_CODES = new Set([
  "ECONNREFUSED",
  "ECONNRESET",
  "ETIMEDOUT",
  "EPIPE",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "ENOTFOUND",
  "EAI_AGAIN",
  "CONNECTION_CLOSED",
  "CONNECTION_ENDED",
  "CONNECTION_DESTROYED",
  "CONNECT_TIMEOUT",
]);

const SQLSTATES = new Set(["57P01", "57P02", "57P03", "53300"]);

function unavailableCode(code: unknown): boolean {
  if (typeof code !== "string") return false;
  return NETWORK_CODES.has(code) || SQLSTATES.has(code) || /^08[0-9A-Z]{3}$/.test(code);
}

export function isDbUnavailable(err: unknown): boolean {
  let e: unknown = err;
  for (let depth = 0; depth < 8 && e !== null && typeof e === "object"; depth++) {
    if (unavailableCode((e as { code?: unknown }).code)) return true;
    // AggregateError: a host name resolving to several addresses, each refused.
    const errors = (e as { errors?: unknown }).errors;
    if (Array.isArray(errors) && errors.some((x) => isDbUnavailable(x))) return true;
    e = (e as { cause?: unknown }).cause;
  }
  return false;
}
