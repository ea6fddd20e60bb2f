/**
 * A streamed exec (`Accept: text/event-stream`) held open by a test: `started` resolves on the
 * first stdout event (the command runs: a test can act while it does), `done` once the stream
 * ends, with its status, the whole stdout, every event, the exit event and when it arrived.
 * The HTTP suites order their steps on these events instead of sleeping.
 */

export interface SseEvent {
  event: string;
  data: Record<string, unknown>;
}

export interface StreamedResult {
  status: number;
  stdout: string;
  events: SseEvent[];
  /** The last event (`exit`, or `error` when the stream ended with one). */
  last: SseEvent | undefined;
  /** The exit event's data, when there was one. */
  exit: Record<string, unknown> | undefined;
  /** performance.now() when the exit event's bytes arrived (Infinity without one). */
  exitAt: number;
}

/** A streamed exec is a command of the suite's own: 2 min bounds a hung one. */
const STREAM_TIMEOUT_MS = 120_000;

/** POSTs `body` to `path` (an exec endpoint) of `baseUrl` with `key`, reading the stream as it comes. */
export function streamedExec(
  baseUrl: string,
  path: string,
  key: string,
  body: unknown,
): { started: Promise<void>; done: Promise<StreamedResult> } {
  let onStart!: () => void;
  const started = new Promise<void>((resolve) => {
    onStart = resolve;
  });
  const done = (async (): Promise<StreamedResult> => {
    const res = await fetch(new URL(path, baseUrl), {
      method: "POST",
      headers: {
        authorization: `Bearer ${key}`,
        "content-type": "application/json",
        accept: "text/event-stream",
      },
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(STREAM_TIMEOUT_MS),
    });
    let text = "";
    let exitAt = Number.POSITIVE_INFINITY;
    const dec = new TextDecoder();
    for await (const chunk of res.body!) {
      text += dec.decode(chunk, { stream: true });
      if (text.includes("event: stdout")) onStart();
      if (text.includes("event: exit") && exitAt === Number.POSITIVE_INFINITY) exitAt = performance.now();
    }
    onStart();
    const events: SseEvent[] = [];
    for (const block of text.split("\n\n")) {
      const event = /^event: (.*)$/m.exec(block)?.[1];
      const data = /^data: (.*)$/m.exec(block)?.[1];
      if (event && data) events.push({ event, data: JSON.parse(data) as Record<string, unknown> });
    }
    const stdout = events
      .filter((e) => e.event === "stdout")
      .map((e) => String(e.data.data))
      .join("");
    const exit = [...events].reverse().find((e) => e.event === "exit")?.data;
    return { status: res.status, stdout, events, last: events.at(-1), exit, exitAt };
  })();
  return { started, done };
}
