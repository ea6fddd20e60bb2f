/**
 * The body of the agent's streamed exec (`POST /v1/vms/{id}/exec?stream=1`, docs/agent-api.md):
 * a sequence of frames, each a 1-byte kind, a 4-byte big-endian length and that many bytes.
 * Output frames carry the guest's bytes as they came (no encoding: a 20 MB output is 20 MB on the
 * wire); the body ends with exactly one `result` (the usual `ExecResult` JSON) or one `error`
 * (`{code, message}` JSON, an agent wire code) frame; a `started` frame (empty) may come first,
 * once the guest has started the command. The agent writes the frames as the guest
 * produces them; the gateway's client reads them one by one (`ExecFrameDecoder`), so a slow
 * reader stops the agent reading the guest (back-pressure, agent/api/exec-stream.ts).
 */
import { SandboxdError } from "../errors.ts";

export const ExecFrameKind = {
  STDOUT: 1,
  STDERR: 2,
  RESULT: 3,
  ERROR: 4,
  /** Empty: the guest started the command. Real bytes, so the answer's headers are flushed now. */
  STARTED: 5,
} as const;
export type ExecFrameKind = (typeof ExecFrameKind)[keyof typeof ExecFrameKind];

/** The header: kind (1 byte) and length (u32 BE). */
export const EXEC_FRAME_HEADER_BYTES = 5;
/**
 * Largest frame either side accepts. A guest output frame is at most one guest protocol payload
 * (1 MiB) and a result or error JSON is a few hundred bytes; anything larger is a broken stream,
 * and bounding it bounds what the reader buffers for one frame.
 */
export const MAX_EXEC_FRAME_BYTES = 1024 * 1024 + 4096;

export function encodeExecFrame(kind: ExecFrameKind, payload: Uint8Array): Uint8Array {
  const out = new Uint8Array(EXEC_FRAME_HEADER_BYTES + payload.length);
  out[0] = kind;
  new DataView(out.buffer).setUint32(1, payload.length);
  out.set(payload, EXEC_FRAME_HEADER_BYTES);
  return out;
}

export interface ExecFrame {
  kind: ExecFrameKind;
  payload: Uint8Array;
}

/** Splits a byte stream into frames; throws on an unknown kind or an oversize length. */
export class ExecFrameDecoder {
  private buf: Uint8Array = new Uint8Array(0);

  push(chunk: Uint8Array): ExecFrame[] {
    this.buf = this.buf.length === 0 ? chunk : concat(this.buf, chunk);
    const frames: ExecFrame[] = [];
    let off = 0;
    while (this.buf.length - off >= EXEC_FRAME_HEADER_BYTES) {
      const kind = this.buf[off] as number;
      const len = new DataView(this.buf.buffer, this.buf.byteOffset + off + 1, 4).getUint32(0);
      if (kind < ExecFrameKind.STDOUT || kind > ExecFrameKind.STARTED) {
        throw new SandboxdError("internal", `exec stream: unknown frame kind ${kind}`);
      }
      if (len > MAX_EXEC_FRAME_BYTES)
        throw new SandboxdError("internal", `exec stream: frame of ${len} bytes`);
      if (this.buf.length - off < EXEC_FRAME_HEADER_BYTES + len) break;
      const start = off + EXEC_FRAME_HEADER_BYTES;
      frames.push({ kind: kind as ExecFrameKind, payload: this.buf.slice(start, start + len) });
      off = start + len;
    }
    this.buf = off === 0 ? this.buf : this.buf.slice(off);
    return frames;
  }

  /** Bytes of an unfinished frame (a body that ends with some is truncated). */
  get pending(): number {
    return this.buf.length;
  }
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array {
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}
