/** The guest agent (C) and the host (TypeScript) must agree on every protocol number. */
import { expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import * as P from "../../contracts/guest-protocol.ts";

const header = readFileSync(join(import.meta.dir, "../../guest/protocol.h"), "utf8");
const defines = new Map<string, number>();
for (const m of header.matchAll(/^#define (SBX_\w+) (0x[0-9a-fA-F]+|\d+)/gm)) {
  defines.set(m[1]!, Number(m[2]));
}

function screaming(prefix: string, table: Record<string, number>): [string, number][] {
  return Object.entries(table).map(([k, v]) => [`${prefix}${k}`, v]);
}

test("protocol.h defines exactly the TypeScript constants", () => {
  const expected = new Map<string, number>([
    ["SBX_MAGIC", P.MAGIC],
    ["SBX_VERSION", P.VERSION],
    ["SBX_HEADER_LEN", P.HEADER_LEN],
    ["SBX_MAX_PAYLOAD", P.MAX_PAYLOAD],
    ["SBX_EXEC_OUTPUT_MAX", P.EXEC_OUTPUT_MAX],
    ["SBX_TUNNEL_WINDOW", P.TUNNEL_WINDOW],
    ["SBX_GUEST_STREAM_BIT", P.GUEST_STREAM_BIT],
    ["SBX_EGRESS_PORT", P.EGRESS_PORT],
    ["SBX_ENTRY_HEADER_LEN", P.ENTRY_HEADER_LEN],
    ...screaming("SBX_T_", P.FrameType),
    ...screaming("SBX_OP_", P.Op),
    ...screaming("SBX_TAG_", P.Tag),
    ...screaming("SBX_STREAM_", P.StreamFlag),
    ...screaming("SBX_ENTRY_", P.EntryType),
  ]);
  expect(Object.fromEntries(defines)).toEqual(Object.fromEntries(expected));
});

test("numbers are unique within each table", () => {
  for (const table of [P.FrameType, P.Op, P.Tag]) {
    const values = Object.values(table);
    expect(new Set(values).size).toBe(values.length);
  }
});
