/**
 * Runs E2B's own JS SDK tests (tests/e2b-sdk/upstream, copied verbatim from packages/js-sdk/tests
 * at e2b@2.45.0) against the installed, unmodified `e2b` package: their imports of the SDK's
 * source (`../src`, `../../../src/index.js`, `../../src/errors`) resolve to the package, whose
 * index exports every name they take from there. The service, the key and the domain come from
 * the environment (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, E2B_DOMAIN), set by
 * tests/e2e/e2b-sdk-suite.test.ts. Tests out of scope (tests/e2b-sdk/scope.ts) are not copied, or
 * are left out by name here.
 *
 * Upstream's setup file (tests/globalFetchFallback.setup.ts) is not used: it reroutes the SDK's
 * undici transport to a late-bound global fetch for msw's mocks, and no test here mocks the network.
 */
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { defineConfig } from "vitest/config";
import { testNamePattern } from "./scope.ts";

const here = dirname(fileURLToPath(import.meta.url));
/** The installed package's ESM entry (its `module` field). */
const sdk = join(dirname(createRequire(import.meta.url).resolve("e2b/package.json")), "dist/index.mjs");

export default defineConfig({
  root: join(here, "upstream"),
  resolve: {
    alias: [
      { find: /^(\.\.\/)+src(\/index(\.js)?)?$/, replacement: sdk },
      { find: /^(\.\.\/)+src\/errors(\.js)?$/, replacement: sdk },
      // Imported for the WriteEntry type alone (erased); the package exports the module's values.
      { find: /^(\.\.\/)+src\/sandbox\/filesystem$/, replacement: sdk },
    ],
  },
  test: {
    include: ["tests/**/*.test.ts"],
    testNamePattern: new RegExp(testNamePattern()),
    environment: "node",
    globals: false,
    // As upstream: each file in its own module graph.
    isolate: true,
    // Two files at a time: the host has 2 cores and the sandboxes' VMs run under TCG beside the
    // suite; each file's tests run one after another, as upstream's.
    maxWorkers: 2,
    fileParallelism: true,
    // Upstream's 30 s per test is sized for E2B's cloud (a create in ~200 ms on KVM); here a
    // pause, resume or fork under TCG on a loaded 2-core host takes several seconds: twice that.
    testTimeout: 60_000,
    hookTimeout: 60_000,
    // Every test runs: a failure is a finding, counted by the runner.
    bail: 0,
    retry: 0,
  },
});
