/**
 * A streamed answer's body (Server-Sent Events, a followed log) read to its end in the
 * background: its text so far, when it ended (`performance.now()`), and a cancel. A body cut
 * instead of ended (the server gone under a failed test) gives NaN, so a bound on the end's time
 * fails rather than passing on a cut. Test code only.
 */
export function followBody(res: Response): {
  state: { text: string };
  ended: Promise<number>;
  cancel: () => Promise<void>;
} {
  const state = { text: "" };
  const reader = (res.body as ReadableStream<Uint8Array>).getReader();
  const dec = new TextDecoder();
  const ended = (async () => {
    for (;;) {
      const r = await reader.read();
      if (r.done) return performance.now();
      state.text += dec.decode(r.value, { stream: true });
    }
  })().catch(() => Number.NaN);
  return { state, ended, cancel: () => reader.cancel() };
}
