import { QmpProtocolError } from "./errors.ts";

/**
 * QMP wire format (QEMU docs/interop/qmp-spec.rst): one JSON object per line, each terminated
 * by "\r\n" from QEMU (we accept "\n"). A message is a greeting, a command answer (`return` or
 * `error`, carrying the `id` we sent) or an asynchronous event.
 */
export interface QmpGreeting {
  kind: "greeting";
  version: { qemu: { major: number; minor: number; micro: number }; package: string };
  capabilities: string[];
}
export interface QmpReturn {
  kind: "return";
  id: string | undefined;
  value: unknown;
}
export interface QmpErrorReply {
  kind: "error";
  id: string | undefined;
  errorClass: string;
  desc: string;
}
export interface QmpEvent {
  kind: "event";
  event: string;
  data: Record<string, unknown>;
  /** Host wall-clock time QEMU stamped on the event. */
  timestamp: { seconds: number; microseconds: number };
}
export type QmpMessage = QmpGreeting | QmpReturn | QmpErrorReply | QmpEvent;

/**
 * Longest line we buffer without a newline. QMP answers to `query-*` commands are a few KiB;
 * the largest we send for (query-qmp-schema) is ~300 KiB. Anything past 16 MiB without a newline
 * is not QMP and would only grow our memory, so it is a protocol error.
 */
export const MAX_LINE_BYTES = 16 * 1024 * 1024;

/**
 * Splits a byte stream into lines. Splitting happens on bytes, before UTF-8 decoding, so a
 * multi-byte character cut across two socket reads is never mangled.
 */
export class LineSplitter {
  private chunks: Buffer[] = [];
  private buffered = 0;
  private readonly decoder = new TextDecoder("utf-8", { fatal: false });

  /** Feeds bytes; returns the complete lines they finish (without the line terminator). */
  push(chunk: Buffer): string[] {
    const lines: string[] = [];
    let start = 0;
    for (;;) {
      const nl = chunk.indexOf(0x0a, start);
      if (nl < 0) break;
      const piece = chunk.subarray(start, nl);
      const whole = this.chunks.length > 0 ? Buffer.concat([...this.chunks, piece]) : piece;
      this.chunks = [];
      this.buffered = 0;
      let line = this.decoder.decode(whole);
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line.trim().length > 0) lines.push(line);
      start = nl + 1;
    }
    if (start < chunk.length) {
      const rest = chunk.subarray(start);
      this.buffered += rest.length;
      if (this.buffered > MAX_LINE_BYTES) {
        this.chunks = [];
        this.buffered = 0;
        throw new QmpProtocolError(`QMP line longer than ${MAX_LINE_BYTES} bytes`);
      }
      // Copy: the caller may reuse the chunk's memory.
      this.chunks.push(Buffer.from(rest));
    }
    return lines;
  }
}

function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** Parses one line into a typed message; anything else is a `QmpProtocolError`. */
export function parseQmpLine(line: string): QmpMessage {
  let obj: unknown;
  try {
    obj = JSON.parse(line);
  } catch (cause) {
    throw new QmpProtocolError("QMP sent a line that is not JSON", {
      cause,
      details: { line: line.slice(0, 200) },
    });
  }
  if (!isRecord(obj)) {
    throw new QmpProtocolError("QMP sent JSON that is not an object", {
      details: { line: line.slice(0, 200) },
    });
  }
  // Our ids are strings; a non-string id cannot be ours and is treated as "no id".
  const id = typeof obj.id === "string" ? obj.id : undefined;
  if ("QMP" in obj) {
    const qmp = obj.QMP;
    if (!isRecord(qmp) || !isRecord(qmp.version)) throw new QmpProtocolError("malformed QMP greeting");
    const caps = Array.isArray(qmp.capabilities) ? qmp.capabilities.filter((c) => typeof c === "string") : [];
    return { kind: "greeting", version: qmp.version as QmpGreeting["version"], capabilities: caps };
  }
  if ("return" in obj) return { kind: "return", id, value: obj.return };
  if ("error" in obj) {
    const err = obj.error;
    if (!isRecord(err) || typeof err.class !== "string") {
      throw new QmpProtocolError("malformed QMP error reply", { details: { line: line.slice(0, 200) } });
    }
    return { kind: "error", id, errorClass: err.class, desc: typeof err.desc === "string" ? err.desc : "" };
  }
  if (typeof obj.event === "string") {
    const ts = isRecord(obj.timestamp) ? obj.timestamp : {};
    return {
      kind: "event",
      event: obj.event,
      data: isRecord(obj.data) ? obj.data : {},
      timestamp: {
        seconds: typeof ts.seconds === "number" ? ts.seconds : 0,
        microseconds: typeof ts.microseconds === "number" ? ts.microseconds : 0,
      },
    };
  }
  throw new QmpProtocolError("QMP sent an object of no known kind", {
    details: { line: line.slice(0, 200) },
  });
}

/** Serialises a command with our id. */
export function encodeQmpCommand(id: string, command: string, args?: Record<string, unknown>): string {
  const msg: Record<string, unknown> = { execute: command, id };
  if (args !== undefined) msg.arguments = args;
  return `${JSON.stringify(msg)}\n`;
}
