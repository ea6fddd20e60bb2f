/**
 * The tier and API checks in a small Hono app, one route per check, a stand-in principal per
 * tier: a key outside the API is 403 `forbidden`, a demo key asking for a Pro feature is 403
 * `demo_tier_limit`, both in the one envelope.
 */
import { expect, test } from "bun:test";
import { Hono } from "hono";
import { API_OF_TIER, type Tier } from "../../contracts/api/tiers.ts";
import type { HonoEnv } from "../deps.ts";
import { errorResponse } from "../errors.ts";
import { requireApi, requirePro, requireScale } from "./guards.ts";

const app = new Hono<HonoEnv>();
app.onError((err, c) => errorResponse(err, c, () => {}));
app.use("*", async (c, next) => {
  const tier = c.req.header("x-tier") as Tier;
  c.set("principal", { tenantId: "t", keyId: "k", tier, api: API_OF_TIER[tier] });
  await next();
});
app.get("/a", (c) => {
  requireApi(c.get("principal"), "sessions");
  return c.text("ok");
});
app.get("/b", (c) => {
  requireApi(c.get("principal"), "sandboxes");
  return c.text("ok");
});
app.get("/scale", (c) => {
  requireScale(c.get("principal"));
  return c.text("ok");
});
app.get("/pro", (c) => {
  requirePro(c.get("principal"), "baking templates");
  return c.text("ok");
});

async function call(path: string, tier: Tier): Promise<{ status: number; body: unknown }> {
  const res = await app.request(path, { headers: { "x-tier": tier } });
  return { status: res.status, body: res.status === 200 ? await res.text() : await res.json() };
}

const OK = { status: 200, body: "ok" };
const forbidden = (message: string) => ({ status: 403, body: { code: "forbidden", message } });

test("api: A is live and scale, B is demo, pro and enterprise", async () => {
  for (const tier of ["live", "scale"] as const) {
    expect(await call("/a", tier)).toEqual(OK);
    expect(await call("/b", tier)).toEqual(
      forbidden(`this endpoint needs a demo, pro or enterprise key; this is a ${tier} key`),
    );
  }
  for (const tier of ["demo", "pro", "enterprise"] as const) {
    expect(await call("/b", tier)).toEqual(OK);
    expect(await call("/a", tier)).toEqual(
      forbidden(`this endpoint needs a live or scale key; this is a ${tier} key`),
    );
  }
});

test("scale: only a scale key; a live key is forbidden, a sandboxes API key is the wrong api", async () => {
  expect(await call("/scale", "scale")).toEqual(OK);
  expect(await call("/scale", "live")).toEqual(
    forbidden("registering or deleting templates needs a scale key"),
  );
  expect(await call("/scale", "enterprise")).toEqual(
    forbidden("this endpoint needs a live or scale key; this is a enterprise key"),
  );
});

test("pro: pro and enterprise; demo is demo_tier_limit; a sessions API key is the wrong api", async () => {
  expect(await call("/pro", "pro")).toEqual(OK);
  expect(await call("/pro", "enterprise")).toEqual(OK);
  expect(await call("/pro", "demo")).toEqual({
    status: 403,
    body: { code: "demo_tier_limit", message: "baking templates needs a pro or enterprise key" },
  });
  expect(await call("/pro", "scale")).toEqual(
    forbidden("this endpoint needs a demo, pro or enterprise key; this is a scale key"),
  );
});
