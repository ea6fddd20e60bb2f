/**
 * Framing and TLV codec of the guest protocol (docs/guest-protocol.md "Framing"; the numbers are
 * in contracts/guest-protocol.ts). Pure functions and one incremental decoder; no I/O.
 *
 * Decoding never throws on bad input: malformed bytes come back as `GuestError` values with code
 * `protocol_error`, so a caller decides what a protocol error means (the host fails the
 * connection). The decoder never buffers more than HEADER_LEN + MAX_PAYLOAD bytes, and it only
 * allocates a frame's payload as its bytes arrive, so a corrupt length costs nothing.
 */
import { type GuestErrorCode, SandboxdError } from "../../contracts/errors.ts";
import { HEADER_LEN, MAGIC, MAX_PAYLOAD, Tag, VERSION } from "../../contracts/guest-protocol.ts";

export type { GuestErrorCode };

/**
 * The one error class of the guest channel. Callers branch on `code`:
 * - `guest_disconnected`: the connection is gone (or never came up); the request's fate is unknown.
 * - `guest_timeout`: no answer in time (the comment at each timeout says why its bound is what it is).
 * - `protocol_error`: bytes that do not follow the protocol (`details.reason` says which rule).
 * - `guest_error`: the guest answered with a non-zero STATUS; `errno` holds it.
 */
export class GuestError extends SandboxdError {
  override readonly code: GuestErrorCode;
  readonly errno: number | undefined;
  constructor(
    code: GuestErrorCode,
    message: string,
    opts?: { cause?: unknown; errno?: number; details?: Record<string, unknown> },
  ) {
    super(code, message, opts);
    this.name = "GuestError";
    this.code = code;
    this.errno = opts?.errno;
  }
}

export interface Frame {
  type: number;
  stream: number;
  payload: Buffer;
}

/** Encodes one frame. Throws `protocol_error` for a payload over MAX_PAYLOAD (a caller bug). */
export function encodeFrame(type: number, stream: number, payload: Uint8Array = new Uint8Array(0)): Buffer {
  const out = Buffer.allocUnsafe(HEADER_LEN + payload.length);
  writeHeader(out, type, stream, payload.length);
  out.set(payload, HEADER_LEN);
  return out;
}

/**
 * A frame's header alone, for a payload sent as it is after it (a large one, which is then not
 * copied into a frame buffer). The same checks as `encodeFrame`.
 */
export function encodeHeader(type: number, stream: number, length: number): Buffer {
  const out = Buffer.allocUnsafe(HEADER_LEN);
  writeHeader(out, type, stream, length);
  return out;
}

function writeHeader(out: Buffer, type: number, stream: number, length: number): void {
  if (length > MAX_PAYLOAD) {
    throw new GuestError("protocol_error", `frame payload ${length} bytes exceeds MAX_PAYLOAD`, {
      details: { reason: "oversize", length },
    });
  }
  if (!Number.isInteger(type) || type < 0 || type > 0xff) throw new RangeError(`frame type ${type}`);
  if (!Number.isInteger(stream) || stream < 0 || stream > 0xffffffff)
    throw new RangeError(`stream id ${stream}`);
  out.writeUInt16LE(MAGIC, 0);
  out.writeUInt8(VERSION, 2);
  out.writeUInt8(type, 3);
  out.writeUInt32LE(stream, 4);
  out.writeUInt32LE(length, 8);
}

export type DecodeEvent = { kind: "frame"; frame: Frame } | { kind: "error"; error: GuestError };

/**
 * Incremental decoder: push chunks cut anywhere, get whole frames back. After the first error it
 * drops everything it buffered and ignores input until `reset()`: on the host a protocol error
 * ends the connection (docs "Framing"), and guessing where the next frame starts is not worth it.
 */
export class FrameDecoder {
  private header = Buffer.alloc(HEADER_LEN);
  private headerLen = 0;
  /**
   * The payload being read, allocated at its announced length once the header is in (bounded by
   * MAX_PAYLOAD, checked first): each input chunk is copied into place once, rather than copied
   * into a list and then concatenated (two copies of every byte a guest sends, and twice the
   * garbage: a 100 MB download made 200 MB of it).
   */
  private payload: Buffer | undefined;
  private payloadHave = 0;
  private payloadNeed = -1; // -1: reading a header
  private type = 0;
  private stream = 0;
  private failed = false;

  /**
   * Bytes received for an incomplete frame; never more than HEADER_LEN + MAX_PAYLOAD (its buffer
   * is the announced length, at most MAX_PAYLOAD).
   */
  get bufferedBytes(): number {
    return this.headerLen + this.payloadHave;
  }

  get hasFailed(): boolean {
    return this.failed;
  }

  reset(): void {
    this.headerLen = 0;
    this.payload = undefined;
    this.payloadHave = 0;
    this.payloadNeed = -1;
    this.failed = false;
  }

  push(input: Uint8Array): DecodeEvent[] {
    const events: DecodeEvent[] = [];
    if (this.failed) return events;
    let buf = Buffer.from(input.buffer, input.byteOffset, input.byteLength);
    while (buf.length > 0) {
      if (this.payloadNeed < 0) {
        const take = Math.min(HEADER_LEN - this.headerLen, buf.length);
        buf.copy(this.header, this.headerLen, 0, take);
        this.headerLen += take;
        buf = buf.subarray(take);
        if (this.headerLen < HEADER_LEN) break;
        const error = this.checkHeader();
        if (error) {
          this.fail();
          events.push({ kind: "error", error });
          return events;
        }
        this.type = this.header.readUInt8(3);
        this.stream = this.header.readUInt32LE(4);
        this.payloadNeed = this.header.readUInt32LE(8);
        this.headerLen = 0;
        if (this.payloadNeed === 0) this.emit(events);
        else this.payload = Buffer.allocUnsafe(this.payloadNeed);
        continue;
      }
      const take = Math.min(this.payloadNeed - this.payloadHave, buf.length);
      // Copy: the caller may reuse its chunk, and a subarray would pin the whole chunk.
      buf.copy(this.payload as Buffer, this.payloadHave, 0, take);
      this.payloadHave += take;
      buf = buf.subarray(take);
      if (this.payloadHave === this.payloadNeed) this.emit(events);
    }
    return events;
  }

  private checkHeader(): GuestError | undefined {
    const magic = this.header.readUInt16LE(0);
    const version = this.header.readUInt8(2);
    const length = this.header.readUInt32LE(8);
    if (magic !== MAGIC) return protocolError("bad_magic", `bad frame magic 0x${magic.toString(16)}`);
    if (version !== VERSION) return protocolError("bad_version", `unsupported protocol version ${version}`);
    if (length > MAX_PAYLOAD) return protocolError("oversize", `frame length ${length} exceeds MAX_PAYLOAD`);
    return undefined;
  }

  private emit(events: DecodeEvent[]): void {
    const payload = this.payload ?? Buffer.alloc(0);
    events.push({ kind: "frame", frame: { type: this.type, stream: this.stream, payload } });
    this.payload = undefined;
    this.payloadHave = 0;
    this.payloadNeed = -1;
  }

  private fail(): void {
    this.reset();
    this.failed = true;
  }
}

function protocolError(reason: string, message: string): GuestError {
  return new GuestError("protocol_error", message, { details: { reason } });
}

// ---------------------------------------------------------------------------------------------
// TLV: u16 tag, u32 len, value (little-endian integers of the width protocol.h gives per tag)

export interface TlvRecord {
  tag: number;
  value: Buffer;
}

/** Builds a TLV list. Integers are range-checked: a silent wrap would change meaning. */
export class TlvWriter {
  private parts: Buffer[] = [];
  private size = 0;

  bytes(tag: number, value: Uint8Array | string): this {
    const v = typeof value === "string" ? Buffer.from(value, "utf8") : value;
    const h = Buffer.allocUnsafe(6);
    h.writeUInt16LE(tag, 0);
    h.writeUInt32LE(v.length, 2);
    this.parts.push(h, Buffer.from(v.buffer, v.byteOffset, v.byteLength));
    this.size += 6 + v.length;
    return this;
  }

  str(tag: number, value: string): this {
    return this.bytes(tag, value);
  }

  u32(tag: number, value: number): this {
    const b = Buffer.allocUnsafe(4);
    b.writeUInt32LE(value, 0);
    return this.bytes(tag, b);
  }

  i32(tag: number, value: number): this {
    const b = Buffer.allocUnsafe(4);
    b.writeInt32LE(value, 0);
    return this.bytes(tag, b);
  }

  u64(tag: number, value: bigint | number): this {
    const b = Buffer.allocUnsafe(8);
    b.writeBigUInt64LE(BigInt(value), 0);
    return this.bytes(tag, b);
  }

  get length(): number {
    return this.size;
  }

  finish(): Buffer {
    return Buffer.concat(this.parts, this.size);
  }
}

/** Parses a TLV list; a record whose length runs past the payload is a protocol error value. */
export function decodeTlv(
  payload: Uint8Array,
): { ok: true; records: TlvRecords } | { ok: false; error: GuestError } {
  const buf = Buffer.from(payload.buffer, payload.byteOffset, payload.byteLength);
  const records: TlvRecord[] = [];
  let off = 0;
  while (off < buf.length) {
    if (buf.length - off < 6) {
      return { ok: false, error: protocolError("bad_tlv", `truncated TLV header at offset ${off}`) };
    }
    const tag = buf.readUInt16LE(off);
    const len = buf.readUInt32LE(off + 2);
    if (len > buf.length - off - 6) {
      return {
        ok: false,
        error: protocolError("bad_tlv", `TLV tag ${tag} length ${len} runs past the payload`),
      };
    }
    records.push({ tag, value: buf.subarray(off + 6, off + 6 + len) });
    off += 6 + len;
  }
  return { ok: true, records: new TlvRecords(records) };
}

/**
 * Typed reads of a decoded TLV list. Tags nobody asks for are skipped (docs: unknown tags are
 * how either side adds fields). A known tag with the wrong width reads as absent.
 */
export class TlvRecords {
  constructor(readonly records: readonly TlvRecord[]) {}

  get(tag: number): Buffer | undefined {
    return this.records.find((r) => r.tag === tag)?.value;
  }

  getAll(tag: number): Buffer[] {
    return this.records.filter((r) => r.tag === tag).map((r) => r.value);
  }

  has(tag: number): boolean {
    return this.records.some((r) => r.tag === tag);
  }

  str(tag: number): string | undefined {
    return this.get(tag)?.toString("utf8");
  }

  u32(tag: number): number | undefined {
    const v = this.get(tag);
    return v?.length === 4 ? v.readUInt32LE(0) : undefined;
  }

  i32(tag: number): number | undefined {
    const v = this.get(tag);
    return v?.length === 4 ? v.readInt32LE(0) : undefined;
  }

  u64(tag: number): bigint | undefined {
    const v = this.get(tag);
    return v?.length === 8 ? v.readBigUInt64LE(0) : undefined;
  }
}

// ---------------------------------------------------------------------------------------------
// Tunnel frames (docs "Tunnels"): CREDIT carries a u32 byte count; CLOSE is empty (clean end) or
// a TLV list with STATUS (errno) and ERROR (text) when the guest side failed.

/** Payload of a CREDIT frame granting `bytes` (1..2^32-1). */
export function encodeCredit(bytes: number): Buffer {
  if (!Number.isInteger(bytes) || bytes <= 0 || bytes > 0xffffffff) throw new RangeError(`credit ${bytes}`);
  const b = Buffer.allocUnsafe(4);
  b.writeUInt32LE(bytes, 0);
  return b;
}

/** A CREDIT payload's byte count, or a protocol error value when it is not exactly a u32. */
export function decodeCredit(
  payload: Uint8Array,
): { ok: true; bytes: number } | { ok: false; error: GuestError } {
  if (payload.length !== 4) {
    return {
      ok: false,
      error: protocolError("bad_credit", `CREDIT payload of ${payload.length} bytes, not 4`),
    };
  }
  return { ok: true, bytes: Buffer.from(payload.buffer, payload.byteOffset, 4).readUInt32LE(0) };
}

/**
 * A CLOSE payload: `undefined` for a clean end, else the guest's failure as a `guest_error`
 * (errno in `errno`). A malformed payload is a protocol error value.
 */
export function decodeClose(
  payload: Uint8Array,
): { ok: true; error: GuestError | undefined } | { ok: false; error: GuestError } {
  if (payload.length === 0) return { ok: true, error: undefined };
  const d = decodeTlv(payload);
  if (!d.ok) return d;
  const status = d.records.u32(Tag.STATUS) ?? 0;
  if (status === 0) return { ok: true, error: undefined };
  const text = d.records.str(Tag.ERROR) ?? `errno ${status}`;
  return { ok: true, error: new GuestError("guest_error", text, { errno: status }) };
}
