/**
 * The house rules the layout depends on, checked on every run so they cannot drift back:
 * the gateway and the agent meet only in contracts/, contracts/ and db/ import nothing above
 * them, the product imports neither the tests nor the benchmark harness (bench/), no import
 * circles, no source file over 1,000 lines outside tests, and comments carry their facts instead
 * of pointing at notes outside the repository.
 */
import { describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname, join, normalize, resolve } from "node:path";

const REPO = resolve(import.meta.dir, "../..");
const tracked = spawnSync("git", ["ls-files", "-z"], { cwd: REPO, encoding: "utf8" })
  .stdout.split("\0")
  .filter(Boolean);
const tsFiles = tracked.filter((f) => f.endsWith(".ts"));
const IMPORT =
  /(?:^|\n)\s*(?:import|export)[^"'`;]*?from\s*["'](\.[^"']+)["']|import\(\s*["'](\.[^"']+)["']\s*\)/g;

function importsOf(file: string): string[] {
  const text = readFileSync(join(REPO, file), "utf8");
  const out: string[] = [];
  for (const m of text.matchAll(IMPORT)) {
    const spec = m[1] ?? m[2];
    if (spec) out.push(normalize(join(dirname(file), spec)));
  }
  return out;
}

const graph = new Map(tsFiles.map((f) => [f, importsOf(f)]));
const inRoom = (room: string) => (f: string) => f.startsWith(`${room}/`);

describe("layout", () => {
  test("the gateway and the agent never import each other (tests/ and cli/ may use both)", () => {
    const crossing: string[] = [];
    for (const [file, deps] of graph) {
      if (inRoom("agent")(file))
        for (const d of deps) if (inRoom("gateway")(d)) crossing.push(`${file} -> ${d}`);
      if (inRoom("gateway")(file))
        for (const d of deps) if (inRoom("agent")(d)) crossing.push(`${file} -> ${d}`);
    }
    expect(crossing).toEqual([]);
  });

  test("contracts/ imports only contracts/; db/ only contracts/ and db/", () => {
    const wrong: string[] = [];
    for (const [file, deps] of graph) {
      if (inRoom("contracts")(file))
        for (const d of deps) if (!inRoom("contracts")(d)) wrong.push(`${file} -> ${d}`);
      if (inRoom("db")(file))
        for (const d of deps) if (!inRoom("contracts")(d) && !inRoom("db")(d)) wrong.push(`${file} -> ${d}`);
    }
    expect(wrong).toEqual([]);
  });

  test("agent/ and gateway/ never import bench/ (the harness drives them; cli/ only dispatches to it)", () => {
    const wrong: string[] = [];
    for (const [file, deps] of graph) {
      if (inRoom("agent")(file) || inRoom("gateway")(file))
        for (const d of deps) if (inRoom("bench")(d)) wrong.push(`${file} -> ${d}`);
    }
    expect(wrong).toEqual([]);
  });

  test("the product never imports tests/ (test helpers live there, not beside the code they drive)", () => {
    const product = ["agent", "gateway", "contracts", "db", "cli", "sdk", "guest"].map(inRoom);
    const wrong: string[] = [];
    for (const [file, deps] of graph) {
      // cli/testing/ is the test command itself: it reads the suite's list of allowed skips.
      if (file.endsWith(".test.ts") || file.startsWith("cli/testing/")) continue;
      if (!product.some((room) => room(file))) continue;
      for (const d of deps) if (inRoom("tests")(d)) wrong.push(`${file} -> ${d}`);
    }
    expect(wrong).toEqual([]);
  });

  test("agent rooms import only rooms to their right; nothing imports agent/api/", () => {
    // The order docs/ARCHITECTURE.md states: a room may skip rooms, never import one to its left.
    // catalog/ (the python image build) stands beside the order and may use any room below api/.
    const order: string[][] = [
      ["api"],
      ["sandbox"],
      ["snapshot"],
      ["vm"],
      ["image", "qemu", "storage", "egress"],
      ["guest"],
      ["host"],
    ];
    const rank = new Map(order.flatMap((rooms, i) => rooms.map((r) => [r, i] as const)));
    // Files directly under agent/ (run.ts, server.ts) are the entry points that wire the rooms.
    const roomOf = (f: string) =>
      f.startsWith("agent/") && f.split("/").length > 2 ? f.split("/")[1] : undefined;
    const wrong: string[] = [];
    for (const [file, deps] of graph) {
      const from = roomOf(file);
      if (from === undefined || file.endsWith(".test.ts")) continue;
      for (const d of deps) {
        const to = roomOf(d);
        if (to === undefined || to === from) continue;
        if (to === "api") wrong.push(`${file} -> ${d} (nothing imports api/)`);
        else if (from === "catalog") continue;
        else if (rank.get(from) === undefined || rank.get(to) === undefined)
          wrong.push(`${file} -> ${d} (a room outside the order)`);
        else if (rank.get(to)! < rank.get(from)!) wrong.push(`${file} -> ${d} (leftward)`);
        else if (rank.get(to) === rank.get(from)) wrong.push(`${file} -> ${d} (same rank)`);
      }
    }
    expect(wrong).toEqual([]);
  });

  test("the README's layout block names every folder of the tree and only folders that exist", () => {
    const readme = readFileSync(join(REPO, "README.md"), "utf8");
    const block = readme.split("\n## Layout\n")[1]?.split("```")[1] ?? "";
    // A line names folders before its description: top-level ones at the margin ("db/ migrations/"),
    // rooms of the last top-level folder indented by two; deeper indents continue a description.
    const named = new Set<string>();
    let parent = "";
    for (const line of block.split("\n")) {
      const m = /^( {0,2})(\S.*?)(\s{2,}|$)/.exec(line);
      if (!m) continue;
      for (const w of m[2]!.split(" ").filter((x) => x.endsWith("/"))) {
        const name = w.replace(/\/$/, "");
        if (m[1] === "") {
          parent = name;
          named.add(name);
        } else named.add(`${parent}/${name}`);
      }
    }
    // Every top-level folder of tracked files, and every room of the agent and the gateway.
    const folders = new Set(
      tracked.flatMap((f) => {
        const parts = f.split("/");
        if (parts.length < 2 || parts[0]!.startsWith(".")) return [];
        const rooms = ["agent", "gateway", "sdk"].includes(parts[0]!) && parts.length > 2;
        return rooms ? [parts[0]!, `${parts[0]}/${parts[1]}`] : [parts[0]!];
      }),
    );
    const missing = [...folders].filter((f) => !named.has(f) && !["agent", "gateway", "sdk"].includes(f));
    const stale = [...named].filter((f) => !folders.has(f));
    expect({ missing, stale }).toEqual({ missing: [], stale: [] });
  });

  test("gateway rooms import what docs/ARCHITECTURE.md says they may", () => {
    // Per room, the gateway rooms and top-level files it may import (a room always its own files).
    const may: Record<string, string[]> = {
      // The dial-out links are WebSockets the runtime serves (agents/dial-hub.ts).
      agents: ["runtime"],
      auth: ["deps.ts", "ids.ts", "core/invalidations.ts"],
      core: ["auth/keys.ts", "deps.ts", "errors.ts", "ids.ts"],
      relay: ["runtime"],
      routes: [
        "core",
        "auth",
        "relay",
        "runtime",
        "deps.ts",
        "errors.ts",
        "http.ts",
        "ids.ts",
        "openapi-file.ts",
      ],
      runtime: [],
    };
    const wrong: string[] = [];
    for (const [file, deps] of graph) {
      const parts = file.split("/");
      if (parts[0] !== "gateway" || parts.length < 3 || file.endsWith(".test.ts")) continue;
      const allowed = may[parts[1]!];
      if (!allowed) continue;
      for (const d of deps) {
        if (!d.startsWith("gateway/") || d.startsWith(`gateway/${parts[1]}/`)) continue;
        const rel = d.slice("gateway/".length);
        if (!allowed.some((a) => rel === a || rel.startsWith(`${a}/`))) wrong.push(`${file} -> ${d}`);
      }
    }
    expect(wrong).toEqual([]);
  });

  test("no import circles, type-only imports included", () => {
    const state = new Map<string, 1 | 2>();
    const cycles: string[] = [];
    const stack: string[] = [];
    const visit = (f: string) => {
      state.set(f, 1);
      stack.push(f);
      for (const d of graph.get(f) ?? []) {
        if (!graph.has(d)) continue;
        if (state.get(d) === 1) cycles.push([...stack.slice(stack.indexOf(d)), d].join(" -> "));
        else if (!state.has(d)) visit(d);
      }
      stack.pop();
      state.set(f, 2);
    };
    for (const f of graph.keys()) if (!state.has(f)) visit(f);
    expect(cycles).toEqual([]);
  });

  test("no source file over 1,000 lines outside tests", () => {
    const source = tracked.filter(
      (f) => /\.(ts|c|h)$/.test(f) && !f.endsWith(".test.ts") && !f.startsWith("tests/"),
    );
    const long = source
      .map((f) => ({ f, lines: readFileSync(join(REPO, f), "utf8").split("\n").length }))
      .filter((x) => x.lines > 1000)
      .map((x) => `${x.f}: ${x.lines}`);
    expect(long).toEqual([]);
  });

  test("comments carry their facts: no pointers to design notes outside the repo or to issues", () => {
    const text = tracked.filter((f) => /\.(ts|c|h|md|yaml)$/.test(f) || f.endsWith("Makefile"));
    // `../shared/` is the workspace beside a checkout, not part of the repository: the spec's rules
    // are stated in docs/api.md, the host facts where they are used.
    const pointer =
      /style\.md|host-facts|shared\/design|shared\/spec|\.\.\/shared\/|\b[Ii]ssue \d+|later issues?\b/;
    const found = text.flatMap((f) =>
      readFileSync(join(REPO, f), "utf8")
        .split("\n")
        .flatMap((line, i) =>
          pointer.test(line) && f !== "tests/style/layout.test.ts" ? [`${f}:${i + 1}: ${line.trim()}`] : [],
        ),
    );
    expect(found).toEqual([]);
  });
});
