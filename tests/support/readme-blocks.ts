/**
 * The README's ```sh blocks and the marker comment above each (tests/e2e/readme.test.ts has the
 * rules): `<!-- readme-test: skip (why) -->` or `<!-- readme-test: {"expect": [...]} -->`. A
 * skipped block that another test runs says so with `deploy step NAME` in its reason: the
 * deployment walk-through's blocks need several hosts, and tests/e2e/containers.test.ts runs
 * each of them, on loopback, by that name.
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";

export interface Block {
  line: number;
  script: string;
  marker: { skip: string } | { expect: string[] };
}

const MARKER = /^<!-- readme-test: (.*) -->$/;

export function readmeBlocks(text: string): Block[] {
  const lines = text.split("\n");
  const out: Block[] = [];
  for (let i = 0; i < lines.length; i++) {
    if (lines[i] !== "```sh") continue;
    const end = lines.indexOf("```", i + 1);
    if (end < 0) throw new Error(`README.md:${i + 1}: unclosed code block`);
    const m = MARKER.exec(lines[i - 1] ?? "");
    if (!m) throw new Error(`README.md:${i + 1}: a sh block without a readme-test marker above it`);
    const spec = m[1]!;
    const marker = spec.startsWith("skip") ? { skip: spec } : (JSON.parse(spec) as { expect: string[] });
    out.push({ line: i + 1, script: lines.slice(i + 1, end).join("\n"), marker });
    i = end;
  }
  return out;
}

/** The README block of deployment step `name` (exactly one). */
export function deployStep(repo: string, name: string): Block {
  const found = readmeBlocks(readFileSync(join(repo, "README.md"), "utf8")).filter(
    (b) => "skip" in b.marker && b.marker.skip.includes(`deploy step ${name})`),
  );
  if (found.length !== 1) throw new Error(`README.md has ${found.length} blocks of deploy step ${name}`);
  return found[0]!;
}
