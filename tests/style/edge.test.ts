/**
 * The edge (edge/, docs/edge.md) runs in an isolate (Cloudflare Workers, workerd, Deno Deploy)
 * with no node built-ins, no filesystem and no TCP: each entry, bundled as an isolate loads it
 * (`bun build --target=browser`, nothing external), imports no `node:` module and carries none of
 * the packages that need them (PGlite, postgres, ws, drizzle). Its sources import only edge/ and
 * contracts/.
 */
import { describe, expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { builtinModules } from "node:module";
import { join, resolve } from "node:path";

const REPO = resolve(import.meta.dir, "../..");
/** Node's built-in modules, as imported with or without the `node:` scheme. */
const NODE_BUILTIN = new RegExp(
  `^(node:.*|(${builtinModules.map((m) => m.replace(/[/]/g, "\\/")).join("|")})(/.*)?)$`,
);

describe("the edge bundle", () => {
  for (const entry of ["edge/worker.ts", "edge/deno.ts"]) {
    test(`${entry}, bundled for the browser, imports no node built-in and no server package`, async () => {
      // Bun's browser target would fill a node built-in in with a polyfill (node:crypto bundles a
      // whole crypto-browserify) and the bundle would show no trace: every import of one, with or
      // without `node:`, is recorded and kept external instead.
      const builtins: string[] = [];
      const built = await Bun.build({
        entrypoints: [join(REPO, entry)],
        target: "browser",
        format: "esm",
        plugins: [
          {
            name: "record-node-builtins",
            setup(build) {
              build.onResolve({ filter: NODE_BUILTIN }, (args) => {
                builtins.push(`${args.importer} -> ${args.path}`);
                return { path: args.path, external: true };
              });
            },
          },
        ],
      });
      expect(built.success).toBe(true);
      expect(builtins).toEqual([]);
      const text = await built.outputs[0]!.text();
      expect(text.match(/["'`]node:[a-z_/]+["'`]/g) ?? []).toEqual([]);
      expect(text.match(/\b(?:require|import)\s*\(\s*["'`][^"'`]+["'`]\s*\)/g) ?? []).toEqual([]);
      expect(text.match(/^\s*import\b.*from\s*["'`][^"'`]+["'`]/gm) ?? []).toEqual([]);
      for (const pkg of ["@electric-sql/pglite", "postgres", "drizzle-orm", "zod", "jose", "ws"])
        expect(text).not.toContain(`node_modules/${pkg}/`);
    });
  }

  test("edge/ imports only edge/ and contracts/ (and hono)", () => {
    const files = readdirSync(join(REPO, "edge"))
      .filter((f) => f.endsWith(".ts") && !f.endsWith(".test.ts"))
      .map((f) => `edge/${f}`);
    expect(files.length).toBeGreaterThan(0);
    const wrong: string[] = [];
    for (const f of files) {
      const text = readFileSync(join(REPO, f), "utf8");
      for (const m of text.matchAll(/^import[^"';]*from\s*["']([^"']+)["']/gm)) {
        const spec = m[1]!;
        const ok = spec === "hono" || spec.startsWith("./") || spec.startsWith("../contracts/");
        if (!ok) wrong.push(`${f} -> ${spec}`);
      }
    }
    expect(wrong).toEqual([]);
  });
});
