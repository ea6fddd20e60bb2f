/** openapi.yaml is generated from contracts/api; this fails when the committed file drifts. */
import { expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { parse } from "yaml";
import { ROUTES } from "../contracts/api/routes.ts";
import { generateOpenApi, OPENAPI_PATH } from "../gateway/openapi.ts";

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
