/** openapi.yaml is generated from contracts/api; this fails when the committed file drifts. */
import { expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { createConfig, lint } from "@redocly/openapi-core";
import { parse } from "yaml";
import { ROUTES } from "../../contracts/api/routes.ts";
import { generateOpenApi, OPENAPI_PATH } from "../../gateway/openapi.ts";

test("committed openapi.yaml equals the generated one (run `bun gateway/openapi.ts`)", () => {
  expect(readFileSync(OPENAPI_PATH, "utf8")).toBe(generateOpenApi());
});

test("every route is described and every $ref resolves", () => {
  const doc = parse(generateOpenApi()) as {
    openapi: string;
    paths: Record<string, Record<string, unknown>>;
    components: { schemas: Record<string, unknown> };
  };
  expect(doc.openapi).toBe("3.1.0");
  for (const r of ROUTES) expect(doc.paths[r.path]?.[r.method]).toBeDefined();
  const refs = [...JSON.stringify(doc).matchAll(/"\$ref":"#\/components\/schemas\/([^"]+)"/g)].map(
    (m) => m[1]!,
  );
  for (const ref of refs) expect(doc.components.schemas[ref]).toBeDefined();
});

/**
 * Lints the committed openapi.yaml with Redocly's `recommended` ruleset (@redocly/openapi-core);
 * any problem left, error or warning, fails. Rules turned off, and why:
 * - info-license: a private service; there is no license to name.
 * - operation-4xx-response: GET /v1/health takes no key, no body and no query, so it has no 4XX.
 * - operation-2xx-response: GET /v1/sandboxes/{id}/connect succeeds with 101 (WebSocket upgrade,
 *   docs/sandboxes.md "Rules of the sandboxes API"), never with a 2XX.
 */
test("openapi.yaml passes the Redocly recommended lint", async () => {
  const config = await createConfig({
    extends: ["recommended"],
    rules: { "info-license": "off", "operation-4xx-response": "off", "operation-2xx-response": "off" },
  });
  const problems = await lint({ ref: OPENAPI_PATH, config });
  const report = problems.map(
    (p) => `${p.severity} ${p.ruleId}: ${p.message} at ${p.location[0]?.pointer ?? "?"}`,
  );
  expect(report).toEqual([]);
});
