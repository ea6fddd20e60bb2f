/**
 * The streamed form of both exec routes (`Accept: text/event-stream`, docs/api.md "Streamed
 * exec"): Server-Sent Events `stdout` / `stderr` with data `{"data": "<utf-8>"}`, or
 * `{"data_b64": "..."}` for a chunk that is not valid UTF-8, in the order the guest wrote them,
 * each written as soon as it arrives; then one `exit` event whose data is the route's usual JSON
 * response (its stdout and stderr empty: the output went as events). A failure after the stream
 * began is one `error` event `{code, message}`, then the end. The answer's status and headers go
 * as soon as the agent has accepted the call (for an exec: the guest started the command), with an
 * SSE comment `: open` so that they are flushed at once, even for a command that stays silent; a
 * refusal before that (busy, a missing cwd, an unknown user) is the ordinary JSON error with its
 * status.
 *
 * Back-pressure: the body holds at most `SSE_BUFFER_BYTES`; past that `onOutput` waits for the
 * client to read, so the agent's body is not read, the agent stops reading the guest, and the
 * command blocks on its pipe. A client that goes away cancels the command, and so does revoking
 * the key that opened the stream (docs/keys-and-auth.md "Revoking a key"): the stream then ends
 * with an `error` event, code `unauthorized`.
 */
import type { ExecResult, ExecStreamOptions } from "../../contracts/agent/api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { streamedAnswer } from "../../contracts/streamed-answer.ts";
import type { KeyConnection } from "../auth/key-connections.ts";
import { mapError } from "../errors.ts";

/**
 * Bytes of encoded events the gateway holds for one streamed exec before it stops reading the
 * agent: 256 KiB keeps a reader that keeps up from ever waiting, and bounds a slow one.
 */
export const SSE_BUFFER_BYTES = 256 * 1024;

/** Whether a request asks for the streamed form. */
export function wantsEventStream(accept: string | undefined): boolean {
  return (accept ?? "").split(",").some((part) => part.trim().split(";")[0]?.trim() === "text/event-stream");
}

const enc = new TextEncoder();
const event = (name: string, data: unknown) =>
  enc.encode(`event: ${name}\ndata: ${JSON.stringify(data)}\n\n`);

export async function sseExec<R = ExecResult>(
  requestSignal: AbortSignal,
  run: (o: ExecStreamOptions) => Promise<R>,
  exitBody: (r: R) => unknown,
  hold?: (conn: KeyConnection) => () => void,
): Promise<Response> {
  const text = { stdout: new Utf8Events("stdout"), stderr: new Utf8Events("stderr") };
  // Held under the caller's key while it streams (`hold`, auth/key-connections.ts): revoking the
  // key aborts the work as a client that went away does, and ends the stream with an `error`.
  const revoked = new AbortController();
  const unhold =
    hold?.({ close: (_code, reason) => revoked.abort(new SandboxdError("unauthorized", reason)) }) ??
    (() => {});
  const ended = new Promise<void>((resolve) =>
    revoked.signal.addEventListener("abort", () => resolve(), { once: true }),
  );
  const answer = await streamedAnswer<R>({
    bufferBytes: SSE_BUFFER_BYTES,
    requestSignal,
    run: (out, signal) => {
      const onOutput = async (stream: "stdout" | "stderr", chunk: Uint8Array) => {
        let room = true;
        for (const e of text[stream].push(chunk)) room = out.write(e) && room;
        // A revocation does not wait for a client that stopped reading.
        if (!room) await Promise.race([out.drained(), ended]);
      };
      const onOpen = () => void out.write(enc.encode(": open\n\n"));
      return run({ onOutput, signal: AbortSignal.any([signal, revoked.signal]), onOpen });
    },
    end: (s) => {
      unhold();
      const last = s.ok
        ? event("exit", exitBody(s.r))
        : event("error", mapError(revoked.signal.aborted ? revoked.signal.reason : s.err).body);
      return [...text.stdout.end(), ...text.stderr.end(), last];
    },
  });
  // The app's one error mapping answers a failure before any output.
  if ("failed" in answer) throw revoked.signal.aborted ? revoked.signal.reason : answer.failed;
  return new Response(answer.body, {
    headers: {
      "content-type": "text/event-stream; charset=utf-8",
      "cache-control": "no-cache",
      // Proxies that buffer (nginx) would hold the events back.
      "x-accel-buffering": "no",
    },
  });
}

/**
 * One output stream's events. A UTF-8 character the guest split across two chunks is held back
 * (at most 3 bytes) and sent with the next chunk, so text stays text; a chunk that is still not
 * valid UTF-8 goes whole as `data_b64`, byte-exact.
 */
export class Utf8Events {
  private tail = new Uint8Array(0);
  private readonly decoder = new TextDecoder("utf-8", { fatal: true });

  constructor(private readonly name: "stdout" | "stderr") {}

  push(chunk: Uint8Array): Uint8Array[] {
    let buf = chunk;
    if (this.tail.length > 0) {
      buf = new Uint8Array(this.tail.length + chunk.length);
      buf.set(this.tail);
      buf.set(chunk, this.tail.length);
      this.tail = new Uint8Array(0);
    }
    const cut = incompleteTail(buf);
    const head = buf.subarray(0, buf.length - cut);
    try {
      const data = this.decoder.decode(head);
      this.tail = buf.slice(buf.length - cut);
      return data.length > 0 ? [event(this.name, { data })] : [];
    } catch {
      return [event(this.name, { data_b64: Buffer.from(buf).toString("base64") })];
    }
  }

  /** What is held back at the end is an unfinished character: bytes. */
  end(): Uint8Array[] {
    if (this.tail.length === 0) return [];
    const out = [event(this.name, { data_b64: Buffer.from(this.tail).toString("base64") })];
    this.tail = new Uint8Array(0);
    return out;
  }
}

/** How many bytes at the end of `b` begin a UTF-8 sequence that is not complete yet (0-3). */
export function incompleteTail(b: Uint8Array): number {
  for (let back = 1; back <= Math.min(3, b.length); back++) {
    const byte = b[b.length - back] as number;
    if ((byte & 0xc0) === 0x80) continue; // a continuation byte: look further back
    const need = byte >= 0xf0 ? 4 : byte >= 0xe0 ? 3 : byte >= 0xc0 ? 2 : 1;
    return need > back ? back : 0;
  }
  return 0;
}
