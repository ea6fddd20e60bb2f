/**
 * Server-Sent Events as the service writes them (docs/exec.md "Per-exec options and streamed exec"): `event:` and
 * `data:` lines, a blank line ending each event, comment lines (`: open`) ignored. A small reader
 * over `Response.body`, so no EventSource is needed (Node has none, and it cannot POST).
 */

export interface SseEvent {
  event: string;
  data: string;
}

/** The events of `body` in order; ends with the body. An event cut off at the end is dropped. */
export async function* readSse(body: ReadableStream<Uint8Array>): AsyncGenerator<SseEvent> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let event = "message";
  let data: string[] = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl = buf.indexOf("\n");
      while (nl >= 0) {
        const line = buf.slice(0, nl).replace(/\r$/, "");
        buf = buf.slice(nl + 1);
        nl = buf.indexOf("\n");
        if (line === "") {
          if (data.length > 0) yield { event, data: data.join("\n") };
          event = "message";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event = value;
        else if (field === "data") data.push(value);
      }
    }
  } finally {
    // Breaking out of the loop cancels the body: the service then cancels the command.
    await reader.cancel().catch(() => undefined);
  }
}
