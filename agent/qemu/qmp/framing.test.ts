import { describe, expect, test } from "bun:test";
import { QmpProtocolError } from "./errors.ts";
import { encodeQmpCommand, LineSplitter, parseQmpLine } from "./framing.ts";

describe("LineSplitter", () => {
  test("splits several lines in one chunk and one line across chunks", () => {
    const s = new LineSplitter();
    expect(s.push(Buffer.from('{"a":1}\r\n{"b":'))).toEqual(['{"a":1}']);
    expect(s.push(Buffer.from("2}"))).toEqual([]);
    expect(s.push(Buffer.from("\r\n\r\n"))).toEqual(['{"b":2}']);
  });

  test("a multi-byte character cut between chunks survives", () => {
    const s = new LineSplitter();
    const bytes = Buffer.from('{"desc":"héllo"}\n');
    const cut = bytes.indexOf(0xc3) + 1;
    expect(s.push(bytes.subarray(0, cut))).toEqual([]);
    expect(s.push(bytes.subarray(cut))).toEqual(['{"desc":"héllo"}']);
  });
});

describe("parseQmpLine", () => {
  test("greeting, return, error, event", () => {
    expect(
      parseQmpLine(
        '{"QMP":{"version":{"qemu":{"major":7,"minor":2,"micro":0},"package":""},"capabilities":["oob"]}}',
      ),
    ).toEqual({
      kind: "greeting",
      version: { qemu: { major: 7, minor: 2, micro: 0 }, package: "" },
      capabilities: ["oob"],
    });
    expect(parseQmpLine('{"return":{},"id":"cmd-1"}')).toEqual({ kind: "return", id: "cmd-1", value: {} });
    expect(parseQmpLine('{"error":{"class":"GenericError","desc":"no"},"id":"x"}')).toEqual({
      kind: "error",
      id: "x",
      errorClass: "GenericError",
      desc: "no",
    });
    expect(parseQmpLine('{"event":"STOP","timestamp":{"seconds":1,"microseconds":2}}')).toEqual({
      kind: "event",
      event: "STOP",
      data: {},
      timestamp: { seconds: 1, microseconds: 2 },
    });
  });

  test("non-JSON and unknown shapes are protocol errors", () => {
    expect(() => parseQmpLine("nope")).toThrow(QmpProtocolError);
    expect(() => parseQmpLine("[1]")).toThrow(QmpProtocolError);
    expect(() => parseQmpLine('{"what":1}')).toThrow(QmpProtocolError);
    expect(() => parseQmpLine('{"error":"x"}')).toThrow(QmpProtocolError);
  });

  test("encode carries our id and omits absent arguments", () => {
    expect(JSON.parse(encodeQmpCommand("cmd-3", "stop"))).toEqual({ execute: "stop", id: "cmd-3" });
    expect(JSON.parse(encodeQmpCommand("cmd-4", "x", { a: 1 }))).toEqual({
      execute: "x",
      id: "cmd-4",
      arguments: { a: 1 },
    });
  });
});
