/** Request parsing at the edge: size-limited JSON body and query, validated by the contract. */
import type { Context } from "hono";
import type { z } from "zod";
import { TOO_LARGE } from "../contracts/api/common.ts";
import { SandboxdError } from "../contracts/errors.ts";

function describeIssues(err: z.ZodError): string {
  return err.issues
    .slice(0, 5)
    .map((i) => (i.path.length > 0 ? `${i.path.join(".")}: ${i.message}` : i.message))
    .join("; ");
}

export function validate<S extends z.ZodType>(schema: S, value: unknown, where: string): z.output<S> {
  const r = schema.safeParse(value);
  if (r.success) return r.data;
  // A field over its size bound (contracts/api/common.ts TOO_LARGE) makes the request too large:
  // 413, as a body over its byte bound is, whatever else is wrong with it.
  const big = r.error.issues.filter((i) => i.code === "custom" && i.params?.[TOO_LARGE] === true);
  if (big.length > 0)
    throw new SandboxdError(
      "payload_too_large",
      `${where}: ${describeIssues({ ...r.error, issues: big } as z.ZodError)}`,
    );
  throw new SandboxdError("bad_request", `invalid ${where}: ${describeIssues(r.error)}`);
}

/** Reads at most `max` bytes (413 beyond, docs/sandboxes.md "Rules of the sandboxes API"), whatever Content-Length claims. */
export async function readBodyLimited(c: Context, max: number): Promise<Uint8Array> {
  const tooLarge = () => new SandboxdError("payload_too_large", `request body is over ${max} bytes`);
  const declared = c.req.header("content-length");
  if (declared !== undefined && Number(declared) > max) throw tooLarge();
  const body = c.req.raw.body;
  if (!body) return new Uint8Array(0);
  const chunks: Uint8Array[] = [];
  let total = 0;
  const reader = body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    total += value.byteLength;
    if (total > max) {
      // Not cancelled: the server drains the rest before answering 413 (runtime/early-answer.ts).
      reader.releaseLock();
      throw tooLarge();
    }
    chunks.push(value);
  }
  const out = new Uint8Array(total);
  let off = 0;
  for (const ch of chunks) {
    out.set(ch, off);
    off += ch.byteLength;
  }
  return out;
}

/** A JSON body, size-limited and validated. An empty body counts as `{}`. */
export async function jsonBody<S extends z.ZodType>(
  c: Context,
  schema: S,
  max: number,
): Promise<z.output<S>> {
  const bytes = await readBodyLimited(c, max);
  let value: unknown = {};
  if (bytes.byteLength > 0) {
    try {
      value = JSON.parse(new TextDecoder().decode(bytes));
    } catch {
      throw new SandboxdError("bad_request", "request body is not valid JSON");
    }
  }
  return validate(schema, value, "request body");
}

export function query<S extends z.ZodType>(c: Context, schema: S): z.output<S> {
  return validate(schema, c.req.query(), "query");
}

/**
 * The query with the parameters named in `repeated` read as arrays (every occurrence, in order;
 * absent when none), the others as their first value, validated.
 */
export function queryWithRepeats<S extends z.ZodType>(
  c: Context,
  schema: S,
  repeated: string[],
): z.output<S> {
  const q: Record<string, string | string[]> = { ...c.req.query() };
  for (const name of repeated) {
    const all = c.req.queries(name);
    if (all === undefined) delete q[name];
    else q[name] = all;
  }
  return validate(schema, q, "query");
}
