/**
 * An answer given before the request's body was read (413 on a declared Content-Length, 401
 * before an upload, any early error) must still reach the client. Most clients send the whole
 * body before reading anything (Python's urllib and requests, most HTTP/1.1 libraries); a server
 * that answers and closes with unread bytes in its receive buffer makes the kernel reset the
 * connection, and such a client sees a broken pipe instead of the status. So, like nginx's
 * lingering close, the server reads and discards what is left of the body before answering, up to
 * `EARLY_DRAIN_MAX_BYTES` and `EARLY_DRAIN_MAX_MS`; past either the answer goes out with
 * `Connection: close` and the client that kept sending may still see the reset (curl, which waits
 * for `100 Continue` on large bodies, never does: with `Expect: 100-continue` nothing is drained).
 */
import { settled } from "../../contracts/best-effort.ts";

/** Body bytes discarded at most before an early answer: a 10 MiB JSON body plus margin. */
export const EARLY_DRAIN_MAX_BYTES = 64 * 1024 * 1024;
/** How long an early answer waits for the rest of the body at most, ms. */
export const EARLY_DRAIN_MAX_MS = 10_000;

/** Reads and discards the unread rest of `request`'s body within the bounds; true when all of it. */
async function drain(body: ReadableStream<Uint8Array>, maxBytes: number, maxMs: number): Promise<boolean> {
  const reader = body.getReader();
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<"late">((resolve) => {
    timer = setTimeout(() => resolve("late"), maxMs);
  });
  let total = 0;
  try {
    for (;;) {
      const r = await Promise.race([reader.read(), late]);
      if (r === "late") return false;
      if (r.done) return true;
      total += r.value.byteLength;
      if (total > maxBytes) return false;
    }
  } catch {
    return false; // the client went away: nothing left to answer
  } finally {
    clearTimeout(timer);
    void settled(reader.cancel()); // the request is answered; the body's own error is moot
  }
}

/**
 * `response` as it should go out for `request`: an error answered while the body is still unread
 * (its stream not taken by a reader) first drains the body.
 */
export async function answerAfterBody(
  request: Request,
  response: Response,
  limits = { maxBytes: EARLY_DRAIN_MAX_BYTES, maxMs: EARLY_DRAIN_MAX_MS },
): Promise<Response> {
  const body = request.body;
  if (response.status < 400 || !body || body.locked) return response;
  if (request.headers.get("expect")?.toLowerCase() === "100-continue") return response;
  if (await drain(body, limits.maxBytes, limits.maxMs)) return response;
  const headers = new Headers(response.headers);
  headers.set("connection", "close");
  return new Response(response.body, { status: response.status, statusText: response.statusText, headers });
}
