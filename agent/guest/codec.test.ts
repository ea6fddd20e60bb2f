import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { FrameType, HEADER_LEN, MAGIC, MAX_PAYLOAD, Tag, VERSION } from "../../contracts/guest-protocol.ts";
import {
  decodeClose,
  decodeCredit,
  decodeTlv,
  encodeCredit,
  encodeFrame,
  type Frame,
  FrameDecoder,
  GuestError,
  TlvWriter,
} from "./codec.ts";

/** Cuts `buf` at the given (sorted, deduplicated) offsets. */
function split(buf: Buffer, cuts: number[]): Buffer[] {
  const points = [...new Set(cuts.map((c) => c % (buf.length + 1)))].sort((a, b) => a - b);
  const out: Buffer[] = [];
  let prev = 0;
  for (const p of points) {
    out.push(buf.subarray(prev, p));
    prev = p;
  }
  out.push(buf.subarray(prev));
  return out;
}

function decodeAll(chunks: Uint8Array[]): { frames: Frame[]; errors: GuestError[]; decoder: FrameDecoder } {
  const decoder = new FrameDecoder();
  const frames: Frame[] = [];
  const errors: GuestError[] = [];
  for (const c of chunks) {
    for (const ev of decoder.push(c)) {
      if (ev.kind === "frame") frames.push(ev.frame);
      else errors.push(ev.error);
    }
  }
  return { frames, errors, decoder };
}

function header(type: number, stream: number, len: number, magic = MAGIC, version = VERSION): Buffer {
  const h = Buffer.alloc(HEADER_LEN);
  h.writeUInt16LE(magic, 0);
  h.writeUInt8(version, 2);
  h.writeUInt8(type, 3);
  h.writeUInt32LE(stream, 4);
  h.writeUInt32LE(len, 8);
  return h;
}

const frameArb = fc.record({
  type: fc.integer({ min: 0, max: 255 }),
  stream: fc.integer({ min: 0, max: 0xffffffff }),
  payload: fc.uint8Array({ maxLength: 3000 }),
});

describe("frames", () => {
  test("header layout is the documented one", () => {
    const f = encodeFrame(FrameType.REQUEST, 0x01020304, Buffer.from("hi"));
    expect([...f]).toEqual([0x42, 0x53, 1, 2, 4, 3, 2, 1, 2, 0, 0, 0, 0x68, 0x69]);
  });

  test("a frame of exactly MAX_PAYLOAD decodes; encode refuses one byte more", () => {
    const big = Buffer.alloc(MAX_PAYLOAD, 7);
    const { frames, errors } = decodeAll([encodeFrame(FrameType.DATA, 9, big)]);
    expect(errors).toEqual([]);
    expect(frames[0]?.payload.length).toBe(MAX_PAYLOAD);
    expect(() => encodeFrame(FrameType.DATA, 9, Buffer.alloc(MAX_PAYLOAD + 1))).toThrow(GuestError);
  });

  test("oversize, bad magic and bad version are typed errors, reported at the header", () => {
    for (const [h, reason] of [
      [header(1, 0, MAX_PAYLOAD + 1), "oversize"],
      [header(1, 0, 0, 0x1234), "bad_magic"],
      [header(1, 0, 0, MAGIC, 2), "bad_version"],
    ] as const) {
      const { frames, errors, decoder } = decodeAll([h]);
      expect(frames).toEqual([]);
      expect(errors.length).toBe(1);
      expect(errors[0]).toBeInstanceOf(GuestError);
      expect(errors[0]?.code).toBe("protocol_error");
      expect(errors[0]?.details?.reason).toBe(reason);
      expect(decoder.bufferedBytes).toBe(0);
      // Failed: ignores input until reset.
      expect(decoder.push(encodeFrame(1, 0))).toEqual([]);
      decoder.reset();
      expect(decoder.push(encodeFrame(1, 0)).length).toBe(1);
    }
  });

  test("empty payloads and frames split byte by byte", () => {
    const bytes = Buffer.concat([
      encodeFrame(1, 0),
      encodeFrame(3, 7, Buffer.from("abc")),
      encodeFrame(11, 0),
    ]);
    const { frames, errors } = decodeAll([...bytes].map((b) => Uint8Array.of(b)));
    expect(errors).toEqual([]);
    expect(frames.map((f) => [f.type, f.stream, f.payload.toString()])).toEqual([
      [1, 0, ""],
      [3, 7, "abc"],
      [11, 0, ""],
    ]);
  });

  test("property: frames round-trip through arbitrary chunking", () => {
    fc.assert(
      fc.property(
        fc.array(frameArb, { maxLength: 12 }),
        fc.array(fc.nat(), { maxLength: 40 }),
        (input, cuts) => {
          const bytes = Buffer.concat(input.map((f) => encodeFrame(f.type, f.stream, f.payload)));
          const { frames, errors, decoder } = decodeAll(split(bytes, cuts));
          expect(errors).toEqual([]);
          expect(decoder.bufferedBytes).toBe(0);
          expect(frames.length).toBe(input.length);
          frames.forEach((f, i) => {
            const want = input[i]!;
            expect(f.type).toBe(want.type);
            expect(f.stream).toBe(want.stream);
            expect(Buffer.compare(f.payload, Buffer.from(want.payload))).toBe(0);
          });
        },
      ),
      { numRuns: 300 },
    );
  });

  test("property: garbage never throws, only yields protocol_error, never buffers past one frame", () => {
    fc.assert(
      fc.property(fc.array(fc.uint8Array({ maxLength: 512 }), { maxLength: 30 }), (chunks) => {
        const decoder = new FrameDecoder();
        let errors = 0;
        for (const c of chunks) {
          const events = decoder.push(c); // must not throw
          for (const ev of events) {
            if (ev.kind === "error") {
              errors++;
              expect(ev.error).toBeInstanceOf(GuestError);
              expect(ev.error.code).toBe("protocol_error");
            }
          }
          expect(decoder.bufferedBytes).toBeLessThanOrEqual(HEADER_LEN + MAX_PAYLOAD);
        }
        expect(errors).toBeLessThanOrEqual(1); // after the first error the decoder is failed
      }),
      { numRuns: 500 },
    );
  });

  test("property: a valid prefix claiming a huge payload buffers only what arrived", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 1, max: MAX_PAYLOAD }),
        fc.array(fc.uint8Array({ maxLength: 4096 }), { maxLength: 8 }),
        (len, chunks) => {
          const decoder = new FrameDecoder();
          decoder.push(header(FrameType.DATA, 1, len));
          let fed = 0;
          for (const c of chunks) {
            decoder.push(c);
            fed += c.length;
            // Only the bytes received are held, whatever the header claims.
            expect(decoder.bufferedBytes).toBeLessThanOrEqual(Math.min(fed, len) + HEADER_LEN);
          }
        },
      ),
      { numRuns: 200 },
    );
  });
});

describe("TLV", () => {
  const recordArb = fc.record({
    tag: fc.integer({ min: 0, max: 0xffff }),
    value: fc.uint8Array({ maxLength: 300 }),
  });

  test("property: TLV lists round-trip, order and repeats kept", () => {
    fc.assert(
      fc.property(fc.array(recordArb, { maxLength: 20 }), (records) => {
        const w = new TlvWriter();
        for (const r of records) w.bytes(r.tag, r.value);
        const d = decodeTlv(w.finish());
        expect(d.ok).toBe(true);
        if (!d.ok) return;
        expect(d.records.records.map((r) => [r.tag, [...r.value]])).toEqual(
          records.map((r) => [r.tag, [...r.value]]),
        );
      }),
    );
  });

  test("property: unknown tags are skipped by typed reads", () => {
    const known = new Set<number>(Object.values(Tag));
    const unknownArb = fc.record({
      tag: fc.integer({ min: 0, max: 0xffff }).filter((t) => !known.has(t)),
      value: fc.uint8Array({ maxLength: 64 }),
    });
    fc.assert(
      fc.property(
        fc.array(unknownArb, { maxLength: 5 }),
        fc.array(unknownArb, { maxLength: 5 }),
        fc.integer({ min: 0, max: 0xffffffff }),
        fc.integer({ min: -0x80000000, max: 0x7fffffff }),
        fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }),
        fc.string(),
        (before, after, u, i, big, s) => {
          const w = new TlvWriter();
          for (const r of before) w.bytes(r.tag, r.value);
          w.u32(Tag.OP, u)
            .i32(Tag.EXIT_CODE, i)
            .u64(Tag.SIZE, big)
            .str(Tag.PATH, s)
            .str(Tag.ARGV, "a")
            .str(Tag.ARGV, "b");
          for (const r of after) w.bytes(r.tag, r.value);
          const d = decodeTlv(w.finish());
          expect(d.ok).toBe(true);
          if (!d.ok) return;
          expect(d.records.u32(Tag.OP)).toBe(u);
          expect(d.records.i32(Tag.EXIT_CODE)).toBe(i);
          expect(d.records.u64(Tag.SIZE)).toBe(big);
          expect(d.records.str(Tag.PATH)).toBe(s);
          expect(d.records.getAll(Tag.ARGV).map((b) => b.toString())).toEqual(["a", "b"]);
          expect(d.records.has(Tag.SIGNAL)).toBe(false);
        },
      ),
    );
  });

  test("truncated records are protocol errors; wrong widths read as absent", () => {
    const good = new TlvWriter().u32(Tag.OP, 1).finish();
    for (let cut = 1; cut < good.length; cut++) {
      const d = decodeTlv(good.subarray(0, cut));
      expect(d.ok).toBe(false);
      if (!d.ok) expect(d.error.code).toBe("protocol_error");
    }
    const d = decodeTlv(new TlvWriter().bytes(Tag.OP, Buffer.from([1, 2])).finish());
    expect(d.ok && d.records.u32(Tag.OP)).toBeUndefined();
  });

  test("property: random bytes as a TLV list never throw", () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 200 }), (bytes) => {
        const d = decodeTlv(bytes);
        if (!d.ok) expect(d.error.code).toBe("protocol_error");
      }),
    );
  });
});

describe("protocol.h agrees with contracts/guest-protocol.ts", () => {
  test("every number matches", async () => {
    const h = await Bun.file(new URL("../../guest/protocol.h", import.meta.url)).text();
    const defs = new Map<string, number>();
    for (const m of h.matchAll(/^#define\s+SBX_(\w+)\s+(0x[0-9a-fA-F]+|\d+)/gm))
      defs.set(m[1]!, Number(m[2]));
    const { Op, FrameType: FT, Tag: T } = await import("../../contracts/guest-protocol.ts");
    expect(defs.get("MAGIC")).toBe(MAGIC);
    expect(defs.get("VERSION")).toBe(VERSION);
    expect(defs.get("HEADER_LEN")).toBe(HEADER_LEN);
    expect(defs.get("MAX_PAYLOAD")).toBe(MAX_PAYLOAD);
    for (const [k, v] of Object.entries(FT)) expect([k, defs.get(`T_${k}`)]).toEqual([k, v]);
    for (const [k, v] of Object.entries(Op)) expect([k, defs.get(`OP_${k}`)]).toEqual([k, v]);
    for (const [k, v] of Object.entries(T)) expect([k, defs.get(`TAG_${k}`)]).toEqual([k, v]);
    const cCount = [...defs.keys()].filter((k) => /^(T|OP|TAG)_/.test(k)).length;
    expect(cCount).toBe(Object.keys(FT).length + Object.keys(Op).length + Object.keys(T).length);
  });
});

describe("tunnel frames (CREDIT, CLOSE)", () => {
  test("CREDIT round-trips every u32 > 0 and refuses 0 or more", () => {
    fc.assert(
      fc.property(fc.integer({ min: 1, max: 0xffffffff }), (n) => {
        const d = decodeCredit(encodeCredit(n));
        expect(d.ok && d.bytes).toBe(n);
      }),
    );
    expect(() => encodeCredit(0)).toThrow(RangeError);
    expect(() => encodeCredit(2 ** 32)).toThrow(RangeError);
    expect(() => encodeCredit(1.5)).toThrow(RangeError);
  });

  test("a CREDIT payload of any other length is a protocol_error value, never a throw", () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 64 }), (bytes) => {
        const d = decodeCredit(bytes);
        if (bytes.length === 4) expect(d.ok).toBe(true);
        else {
          expect(d.ok).toBe(false);
          if (!d.ok) expect(d.error.code).toBe("protocol_error");
        }
      }),
    );
  });

  test("CLOSE: empty is a clean end; STATUS/ERROR round-trip as a guest_error with errno", () => {
    expect(decodeClose(new Uint8Array(0))).toEqual({ ok: true, error: undefined });
    fc.assert(
      fc.property(fc.integer({ min: 0, max: 0xffffffff }), fc.string({ maxLength: 200 }), (status, text) => {
        const d = decodeClose(new TlvWriter().u32(Tag.STATUS, status).str(Tag.ERROR, text).finish());
        expect(d.ok).toBe(true);
        if (!d.ok) return;
        if (status === 0) expect(d.error).toBeUndefined();
        else {
          expect(d.error?.code).toBe("guest_error");
          expect(d.error?.errno).toBe(status);
          expect(d.error?.message).toBe(text);
        }
      }),
    );
  });

  test("arbitrary CLOSE payloads decode to a value, never a throw", () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 300 }), (bytes) => {
        const d = decodeClose(bytes);
        if (!d.ok) expect(d.error.code).toBe("protocol_error");
      }),
    );
  });

  test("tunnel frames go through the incremental decoder cut anywhere", () => {
    fc.assert(
      fc.property(
        fc.array(
          fc.record({
            type: fc.constantFrom(FrameType.DATA, FrameType.CREDIT, FrameType.CLOSE),
            stream: fc.integer({ min: 1, max: 0xffffffff }),
            payload: fc.uint8Array({ maxLength: 2000 }),
          }),
          { maxLength: 8 },
        ),
        fc.array(fc.nat(), { maxLength: 10 }),
        (frames, cuts) => {
          const bytes = Buffer.concat(frames.map((f) => encodeFrame(f.type, f.stream, f.payload)));
          const { frames: got, errors } = decodeAll(split(bytes, cuts));
          expect(errors).toEqual([]);
          expect(got.map((f) => [f.type, f.stream, Buffer.from(f.payload)])).toEqual(
            frames.map((f) => [f.type, f.stream, Buffer.from(f.payload)]),
          );
        },
      ),
    );
  });
});
