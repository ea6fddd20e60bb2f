/**
 * The two internal routes agents call (enroll, heartbeat: outside the public /v1 API and its
 * error middleware) answer `{code, message}` like every other route; this is their body parsing.
 */
import type { z } from "zod";

export function jsonAnswer(status: number, body: unknown): Response {
  return Response.json(body, { status });
}

/** The request's JSON body checked by `schema`, or the 400 answer to send instead. */
export async function parseJsonBody<T extends z.ZodType>(
  request: Request,
  schema: T,
  what: string,
): Promise<{ ok: true; data: z.infer<T> } | { ok: false; answer: Response }> {
  let body: unknown;
  try {
    body = await request.json();
  } catch {
    return {
      ok: false,
      answer: jsonAnswer(400, { code: "bad_request", message: `${what} body is not JSON` }),
    };
  }
  const r = schema.safeParse(body);
  if (!r.success)
    return { ok: false, answer: jsonAnswer(400, { code: "bad_request", message: r.error.message }) };
  return { ok: true, data: r.data };
}
