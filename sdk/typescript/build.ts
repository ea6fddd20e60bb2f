/**
 * Builds the SDK for Node and Deno: one ESM file, `dist/index.js`, from `src/index.ts` with Bun's
 * bundler (type-only imports of the contracts vanish, so the file has no imports but node:net and
 * node:tls). Bun itself runs the TypeScript source (package.json's `bun` condition). `dist/` is
 * not committed: it is generated, and the SDK's test builds it before running the examples under
 * Node and Deno, so it cannot drift from the source.
 *
 *   bun sdk/typescript/build.ts
 */
import { join } from "node:path";

const root = import.meta.dir;

export async function buildSdk(): Promise<string> {
  const r = await Bun.build({
    entrypoints: [join(root, "src/index.ts")],
    outdir: join(root, "dist"),
    target: "node",
    format: "esm",
    sourcemap: "linked",
  });
  if (!r.success) throw new AggregateError(r.logs, "SDK build failed");
  return join(root, "dist/index.js");
}

if (import.meta.main) console.log(await buildSdk());
