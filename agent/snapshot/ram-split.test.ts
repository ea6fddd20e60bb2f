/**
 * The splitter on streams built here in QEMU 7.2's format: what it writes where, and every
 * hostile or broken stream refused with nothing left behind. A real QEMU's stream through it is
 * checked by the VM tests (tests/vm/snapshot-engine.test.ts: children's memory page by page).
 */
import { afterAll, beforeEach, expect, test } from "bun:test";
import { existsSync, mkdtempSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  be32,
  be64,
  DEVICES,
  eos,
  footer,
  header,
  name,
  pageRec,
  part,
  ramStart,
  zeroRec,
} from "../../tests/fixtures/migration-stream.ts";
import { PAGE_BYTES, RamSplitter } from "./ram-split.ts";

const dir = mkdtempSync(join(tmpdir(), "ram-split-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
let n = 0;
let ramPath = "";
let statePath = "";
beforeEach(() => {
  n++;
  ramPath = join(dir, `${n}.mem`);
  statePath = join(dir, `${n}.state`);
});

const RAM = 16 * PAGE_BYTES;
const BLOCKS: [string, number][] = [
  ["mem", RAM],
  ["pc.bios", 2 * PAGE_BYTES],
];

function stream(...ramParts: Buffer[]): Buffer {
  return Buffer.concat([header(), ramStart(BLOCKS), eos(), footer(2), ...ramParts, DEVICES]);
}

/** Feeds `data` in `chunk`-byte pieces (records cut anywhere) and ends it. */
async function split(data: Buffer, chunk = 1000) {
  const s = await RamSplitter.open({ ramBlock: "mem", ramBytes: RAM, ramPath, statePath });
  try {
    for (let i = 0; i < data.length; i += chunk) await s.write(data.subarray(i, i + chunk));
    return await s.end();
  } catch (err) {
    await s.abort();
    throw err;
  }
}

test("the RAM block's pages go to the RAM file at their offsets; everything else to the state, as it was", async () => {
  const data = stream(
    part(pageRec("mem", 0, 0xaa), pageRec(undefined, PAGE_BYTES, 0xbb), zeroRec(undefined, 2 * PAGE_BYTES)),
    part(pageRec("pc.bios", PAGE_BYTES, 0xcc), pageRec("mem", 9 * PAGE_BYTES, 0xdd)),
  );
  for (const chunk of [1, 7, 4096, 1 << 20]) {
    beforeEachManual();
    const r = await split(data, chunk);
    expect(r.ramPages).toBe(3);
    const ram = readFileSync(ramPath);
    expect(ram.length).toBe(RAM);
    expect(ram.subarray(0, PAGE_BYTES).every((b) => b === 0xaa)).toBe(true);
    expect(ram.subarray(PAGE_BYTES, 2 * PAGE_BYTES).every((b) => b === 0xbb)).toBe(true);
    expect(ram.subarray(2 * PAGE_BYTES, 9 * PAGE_BYTES).every((b) => b === 0)).toBe(true);
    expect(ram.subarray(9 * PAGE_BYTES, 10 * PAGE_BYTES).every((b) => b === 0xdd)).toBe(true);
    // The zero page stays a hole: the file holds only the pages written.
    expect(statSync(ramPath).blocks * 512).toBeLessThan(RAM);
    // The state: the stream without the RAM block's records, byte for byte.
    const expected = Buffer.concat([
      header(),
      ramStart(BLOCKS),
      eos(),
      footer(2),
      part(),
      part(pageRec("pc.bios", PAGE_BYTES, 0xcc)),
      DEVICES,
    ]);
    expect(Buffer.compare(readFileSync(statePath), expected)).toBe(0);
    expect(r.stateBytes).toBe(expected.length);
  }
});

function beforeEachManual() {
  n++;
  ramPath = join(dir, `${n}.mem`);
  statePath = join(dir, `${n}.state`);
}

test("a page sent again (a live precopy) is the last copy; one that became zero is zero again", async () => {
  await split(
    stream(
      part(pageRec("mem", 0, 1), pageRec("mem", 3 * PAGE_BYTES, 2)),
      part(pageRec("mem", 0, 9), zeroRec("mem", 3 * PAGE_BYTES)),
    ),
  );
  const ram = readFileSync(ramPath);
  expect(ram.subarray(0, PAGE_BYTES).every((b) => b === 9)).toBe(true);
  expect(ram.subarray(3 * PAGE_BYTES, 4 * PAGE_BYTES).every((b) => b === 0)).toBe(true);
});

const hostile: [string, () => Buffer, string][] = [
  [
    "not a migration stream",
    () => Buffer.from("GIF89a not qemu at all........"),
    "not a QEMU migration stream",
  ],
  ["another stream version", () => Buffer.concat([be32(0x5145564d), be32(2)]), "version 2"],
  ["a page past its block's end", () => stream(part(pageRec("mem", RAM, 1))), "past the end"],
  ["a page of a block the list never named", () => stream(part(pageRec("vga.vram", 0, 1))), "unknown block"],
  ["CONTINUE with no block before it", () => stream(part(pageRec(undefined, 0, 1))), "names no block"],
  ["an unknown record flag (XBZRLE)", () => stream(part(be64(0x40))), "record flags 0x40"],
  [
    "the RAM block with another size than the children map",
    () => Buffer.concat([header(), ramStart([["mem", 2 * RAM]]), eos(), footer(2), DEVICES]),
    "children map",
  ],
  [
    "no RAM block of that name",
    () => Buffer.concat([header(), ramStart([["other", RAM]]), eos(), footer(2), DEVICES]),
    'no RAM block "mem"',
  ],
  [
    "saved without x-ignore-shared",
    () =>
      Buffer.concat([
        header(["events"]),
        ramStart([["mem", RAM]]).subarray(0, -8),
        eos(),
        footer(2),
        DEVICES,
      ]),
    "without x-ignore-shared",
  ],
  [
    "an iterative section other than ram",
    () => Buffer.concat([header(), Buffer.from([0x01]), be32(5), name("block"), be32(0), be32(1)]),
    'iterative section "block"',
  ],
  [
    "a part of a section that is not ram's",
    () => Buffer.concat([header(), ramStart(BLOCKS), eos(), footer(2), Buffer.from([0x02]), be32(9)]),
    "not ram's",
  ],
  ["an unknown section type", () => Buffer.concat([header(), Buffer.from([0x08])]), "section type 0x8"],
  [
    "an unknown configuration subsection",
    () => Buffer.concat([header(), Buffer.from([0x05]), name("configuration/novel"), be32(1)]),
    "configuration subsection",
  ],
  [
    "a stream cut in the middle of a page",
    () => stream(part(pageRec("mem", 0, 1))).subarray(0, 300),
    "ended in the middle",
  ],
  [
    "a block list that claims more than it lists",
    () =>
      Buffer.concat([
        header(),
        Buffer.from([0x01]),
        be32(2),
        name("ram"),
        be32(0),
        be32(4),
        be64((RAM + 64 * PAGE_BYTES) | 0x04),
        name("mem"),
        be64(RAM),
        be64(0),
      ]),
    "ended in the middle",
  ],
];

for (const [what, make, message] of hostile)
  test(`refused, both files removed: ${what}`, async () => {
    await expect(split(make(), 64)).rejects.toThrow(message);
    expect(existsSync(ramPath)).toBe(false);
    expect(existsSync(statePath)).toBe(false);
  });

test("a RAM file or state file that exists already is not overwritten", async () => {
  await Bun.write(ramPath, "someone else's");
  await expect(RamSplitter.open({ ramBlock: "mem", ramBytes: RAM, ramPath, statePath })).rejects.toThrow();
  expect(readFileSync(ramPath, "utf8")).toBe("someone else's");
  expect(existsSync(statePath)).toBe(false);
});

/** Feeds `data` to a delta split keeping the pages marked in `keep`. */
async function delta(data: Buffer, keepPages: number[], chunk = 1000) {
  const keep = new Uint8Array(RAM / PAGE_BYTES);
  for (const p of keepPages) keep[p] = 1;
  const s = await RamSplitter.open({ ramBlock: "mem", ramBytes: RAM, statePath, keep });
  for (let i = 0; i < data.length; i += chunk) await s.write(data.subarray(i, i + chunk));
  return s.end();
}

test("a delta keeps the RAM block's records of the pages marked its own, drops the rest, makes no RAM file", async () => {
  const data = stream(
    part(pageRec("mem", 0, 1), pageRec(undefined, PAGE_BYTES, 2), zeroRec(undefined, 2 * PAGE_BYTES)),
    part(pageRec(undefined, 3 * PAGE_BYTES, 4), pageRec("pc.bios", 0, 5)),
  );
  for (const chunk of [1, 13, 1 << 20]) {
    beforeEachManual();
    await delta(data, [1, 2, 3], chunk);
    expect(existsSync(ramPath)).toBe(false);
    // Page 0 (not its own) is dropped, and with it the record that named the block: the first
    // record kept names it instead of saying CONTINUE; the ones after it may continue.
    const expected = Buffer.concat([
      header(),
      ramStart(BLOCKS),
      eos(),
      footer(2),
      part(pageRec("mem", PAGE_BYTES, 2), zeroRec(undefined, 2 * PAGE_BYTES)),
      part(pageRec(undefined, 3 * PAGE_BYTES, 4), pageRec("pc.bios", 0, 5)),
      DEVICES,
    ]);
    expect(Buffer.compare(readFileSync(statePath), expected)).toBe(0);
  }
});

test("a delta after another block's record names its block again", async () => {
  const data = stream(part(pageRec("mem", 0, 1), pageRec("pc.bios", 0, 5), pageRec("mem", PAGE_BYTES, 2)));
  await delta(data, [1]);
  const expected = Buffer.concat([
    header(),
    ramStart(BLOCKS),
    eos(),
    footer(2),
    part(pageRec("pc.bios", 0, 5), pageRec("mem", PAGE_BYTES, 2)),
    DEVICES,
  ]);
  expect(Buffer.compare(readFileSync(statePath), expected)).toBe(0);
});

test("a keep map of another size than the RAM is refused before a file is made", async () => {
  await expect(
    RamSplitter.open({ ramBlock: "mem", ramBytes: RAM, statePath, keep: new Uint8Array(3) }),
  ).rejects.toThrow("keep map of 3 pages");
  expect(existsSync(statePath)).toBe(false);
});
