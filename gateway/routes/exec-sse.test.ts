import { expect, test } from "bun:test";
import { ExecFrameDecoder, ExecFrameKind, encodeExecFrame } from "../../contracts/agent/exec-stream.ts";
import { incompleteTail, Utf8Events } from "./exec-sse.ts";

const parse = (evs: Uint8Array[]) =>
  evs.map((e) => {
    const t = new TextDecoder().decode(e);
    return { event: /^event: (.*)$/m.exec(t)?.[1], data: JSON.parse(/^data: (.*)$/m.exec(t)?.[1] ?? "null") };
  });

test("incompleteTail finds an unfinished UTF-8 sequence at the end, and only that", () => {
  const e = Buffer.from("é€😀"); // 2, 3 and 4 bytes
  expect(incompleteTail(e)).toBe(0);
  expect(incompleteTail(e.subarray(0, e.length - 1))).toBe(3);
  expect(incompleteTail(e.subarray(0, e.length - 3))).toBe(1);
  expect(incompleteTail(Buffer.from([0x61, 0xc3]))).toBe(1);
  expect(incompleteTail(Buffer.from([0x61, 0xe2, 0x82]))).toBe(2);
  expect(incompleteTail(Buffer.from("abc"))).toBe(0);
  expect(incompleteTail(Buffer.from([0x80, 0x80, 0x80, 0x80]))).toBe(0); // not a start: no hold
});

test("a character split across chunks is sent whole; bytes that are not UTF-8 go as data_b64", () => {
  const u = new Utf8Events("stdout");
  const euro = Buffer.from("€");
  expect(parse(u.push(Buffer.concat([Buffer.from("a"), euro.subarray(0, 1)])))).toEqual([
    { event: "stdout", data: { data: "a" } },
  ]);
  expect(parse(u.push(euro.subarray(1, 2)))).toEqual([]);
  expect(parse(u.push(Buffer.concat([euro.subarray(2), Buffer.from("b")])))).toEqual([
    { event: "stdout", data: { data: "€b" } },
  ]);
  expect(parse(u.push(Buffer.from([0xff, 0x61])))).toEqual([{ event: "stdout", data: { data_b64: "/2E=" } }]);
  expect(parse(u.push(Buffer.from([0xc3])))).toEqual([]);
  expect(parse(u.end())).toEqual([{ event: "stdout", data: { data_b64: "ww==" } }]);
  expect(u.end()).toEqual([]);
});

test("exec frames survive any split of the byte stream; a bad kind or length is refused", () => {
  const frames = [
    encodeExecFrame(ExecFrameKind.STDOUT, Buffer.from("hello")),
    encodeExecFrame(ExecFrameKind.STDERR, new Uint8Array(0)),
    encodeExecFrame(ExecFrameKind.RESULT, Buffer.from("{}")),
  ];
  const all = Buffer.concat(frames);
  for (let cut = 0; cut <= all.length; cut++) {
    const d = new ExecFrameDecoder();
    const got = [...d.push(all.subarray(0, cut)), ...d.push(all.subarray(cut))];
    expect(got.map((f) => [f.kind, Buffer.from(f.payload).toString()])).toEqual([
      [1, "hello"],
      [2, ""],
      [3, "{}"],
    ]);
    expect(d.pending).toBe(0);
  }
  expect(() => new ExecFrameDecoder().push(Buffer.from([9, 0, 0, 0, 0]))).toThrow();
  expect(() => new ExecFrameDecoder().push(Buffer.from([1, 0xff, 0, 0, 0]))).toThrow();
});
