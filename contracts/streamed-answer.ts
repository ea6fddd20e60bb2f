/**
 * The shape both sides give a streamed exec's answer (the agent's frames, agent/api/exec-stream.ts;
 * the gateway's Server-Sent Events, gateway/routes/exec-sse.ts): a body that holds at most
 * `bufferBytes` before its producer is told to wait, whose headers wait for the first output (or
 * the end) so that a refusal before any output is an ordinary error answer, and whose reader going
 * away (or the request ending) aborts the work.
 */

export type Settled<R> = { ok: true; r: R } | { ok: false; err: unknown };

export interface StreamedAnswerOptions<R> {
  /** Bytes the body holds before `Output.write` says "full". */
  bufferBytes: number;
  /** The request's own signal: its end aborts the work like the body's cancel does. */
  requestSignal: AbortSignal;
  /** Does the work, writing output as it comes; `signal` aborts when nobody reads any more. */
  run: (out: Output, signal: AbortSignal) => Promise<R>;
  /** The last bytes of the body once the work settled (a result, or an error). */
  end: (s: Settled<R>) => Uint8Array[];
}

export interface Output {
  /** Queues bytes of output; false when the body is over its bound (wait for `drained`). */
  write(bytes: Uint8Array): boolean;
  /** Resolves once the reader has taken the body under its bound (or is gone). */
  drained(): Promise<void>;
}

/**
 * `{ body }` once output began or the work ended well; `{ failed }` when it failed before any
 * output (answer that as an ordinary error: the body is cancelled already).
 */
export async function streamedAnswer<R>(
  o: StreamedAnswerOptions<R>,
): Promise<{ body: ReadableStream<Uint8Array> } | { failed: unknown }> {
  const cancel = new AbortController();
  const onRequestEnd = () => cancel.abort();
  o.requestSignal.addEventListener("abort", onRequestEnd, { once: true });
  let ctl!: ReadableStreamDefaultController<Uint8Array>;
  let drain: (() => void) | undefined;
  const wake = () => {
    drain?.();
    drain = undefined;
  };
  const body = new ReadableStream<Uint8Array>(
    {
      start(c) {
        ctl = c;
      },
      pull: wake,
      cancel() {
        cancel.abort();
        wake();
      },
    },
    { highWaterMark: o.bufferBytes, size: (chunk) => chunk?.byteLength ?? 0 },
  );
  let started!: () => void;
  const first = new Promise<void>((resolve) => {
    started = resolve;
  });
  let closed = false;
  let outputs = 0;
  const room = () => cancel.signal.aborted || (ctl.desiredSize ?? 0) > 0;
  const push = (bytes: Uint8Array) => {
    if (!closed && !cancel.signal.aborted) ctl.enqueue(bytes);
  };
  const out: Output = {
    write(bytes) {
      push(bytes);
      outputs++;
      started();
      return room();
    },
    drained: () =>
      new Promise<void>((resolve) => {
        if (room()) resolve();
        else drain = resolve;
      }),
  };
  const settled: Promise<Settled<R>> = o.run(out, cancel.signal).then(
    (r) => ({ ok: true, r }),
    (err: unknown) => ({ ok: false, err }),
  );
  void settled.then((s) => {
    o.requestSignal.removeEventListener("abort", onRequestEnd);
    for (const bytes of o.end(s)) push(bytes);
    closed = true;
    try {
      ctl.close();
    } catch {
      // cancelled by the reader already
    }
    started();
  });
  await first;
  const early = await Promise.race([settled, Promise.resolve(undefined)]);
  if (early && !early.ok && outputs === 0) {
    void body.cancel();
    return { failed: early.err };
  }
  return { body };
}
