/**
 * The key middleware alone, in a two-route Hono app over a real PGlite db with keys issued by
 * keys.ts: every refusal is 401 in the one envelope and never reaches the handler; a valid key
 * puts its principal on the context. A WebSocket upgrade may carry the key as its second
 * subprotocol after the `sandboxd` marker (what a browser can send); end to end through the
 * service: tests/e2e/console.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Hono } from "hono";
import { keyFromWsProtocols } from "../../contracts/api/api-key.ts";
import { type DbHandle, openDb } from "../../db/client.ts";
import type { HonoEnv } from "../deps.ts";
import { errorResponse } from "../errors.ts";
import { bearerKey } from "./bearer.ts";
import { VerifiedKeys } from "./key-cache.ts";
import { createKey, type IssuedKey, revokeKey } from "./keys.ts";

const PEPPER = "bearer-test-pepper-0123";

let dir: string;
let handle: DbHandle;
let app: Hono<HonoEnv>;
let pro: IssuedKey;
let live: IssuedKey;
let handled = 0;

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "sandboxd-bearer-"));
  handle = await openDb({ dataDir: dir });
  pro = await createKey(handle.db, PEPPER, { tenant: "acme", tier: "pro" });
  live = await createKey(handle.db, PEPPER, { tenant: "globex", tier: "live" });
  app = new Hono<HonoEnv>();
  app.onError((err, c) => errorResponse(err, c, () => {}));
  app.get("/open", (c) => c.text("no key needed"));
  app.use("/auth/*", bearerKey(new VerifiedKeys({ db: handle.db, pepper: PEPPER })));
  app.get("/auth/whoami", (c) => {
    handled++;
    return c.json(c.get("principal"));
  });
});

afterAll(async () => {
  await handle.close();
  rmSync(dir, { recursive: true, force: true });
});

function get(authorization?: string): Promise<Response> {
  const headers: Record<string, string> = {};
  if (authorization !== undefined) headers.authorization = authorization;
  return Promise.resolve(app.request("/auth/whoami", { headers }));
}

async function expect401(res: Response, message: string): Promise<void> {
  expect(res.status).toBe(401);
  expect(await res.json()).toEqual({ code: "unauthorized", message });
}

const MISSING = "missing API key: send Authorization: Bearer <key>";
const INVALID = "invalid API key";

describe("refused with 401 before the handler", () => {
  test("no Authorization header", async () => {
    const before = handled;
    await expect401(await get(), MISSING);
    expect(handled).toBe(before);
  });

  test("a header that is not one Bearer token", async () => {
    const before = handled;
    for (const header of [
      "",
      "Bearer",
      "Bearer ",
      `Basic ${pro.key}`,
      `Bearer${pro.key}`,
      `Bearer ${pro.key} extra`,
      pro.key,
    ]) {
      await expect401(await get(header), MISSING);
    }
    expect(handled).toBe(before);
  });

  test("a key that is not ours, is tampered, claims another tier, or was revoked", async () => {
    const gone = await createKey(handle.db, PEPPER, { tenant: "acme", tier: "pro" });
    expect(await revokeKey(handle.db, gone.keyId)).toBe(true);
    const before = handled;
    for (const key of [
      "nope",
      "svc_pro_aaaaaaaaaaaa_bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", // well-formed, unknown id
      `${pro.key.slice(0, -1)}${pro.key.endsWith("x") ? "y" : "x"}`, // last secret character changed
      pro.key.replace("svc_pro_", "svc_enterprise_"), // the stored tier wins
      gone.key,
    ]) {
      await expect401(await get(`Bearer ${key}`), INVALID);
    }
    expect(handled).toBe(before);
  });

  test("the same key under another pepper", async () => {
    const other = new Hono<HonoEnv>();
    other.onError((err, c) => errorResponse(err, c, () => {}));
    other.use("*", bearerKey(new VerifiedKeys({ db: handle.db, pepper: "another-pepper-0123456789" })));
    other.get("/", (c) => c.text("reached"));
    await expect401(await other.request("/", { headers: { authorization: `Bearer ${pro.key}` } }), INVALID);
  });
});

describe("a valid key", () => {
  test("sets the principal: tenant, key id, tier and api", async () => {
    const res = await get(`Bearer ${pro.key}`);
    expect(res.status).toBe(200);
    expect(await res.json()).toEqual({
      tenantId: pro.tenantId,
      keyId: pro.keyId,
      tier: "pro",
      api: "sandboxes",
    });
    const a = await get(`Bearer ${live.key}`);
    expect(await a.json()).toEqual({
      tenantId: live.tenantId,
      keyId: live.keyId,
      tier: "live",
      api: "sessions",
    });
  });

  test("the scheme in any case, with blanks around the key", async () => {
    for (const header of [`bearer ${pro.key}`, `BEARER   ${pro.key}`, `Bearer\t${pro.key}  `]) {
      expect((await get(header)).status).toBe(200);
    }
  });

  test("paths outside the middleware need no key", async () => {
    const res = await app.request("/open");
    expect(res.status).toBe(200);
    expect(await res.text()).toBe("no key needed");
  });
});

describe("the key as a WebSocket subprotocol", () => {
  const upgrade = (protocols: string, authorization?: string) =>
    Promise.resolve(
      app.request("/auth/whoami", {
        headers: {
          upgrade: "websocket",
          "sec-websocket-protocol": protocols,
          ...(authorization !== undefined ? { authorization } : {}),
        },
      }),
    );

  test("the marker, then the key: the key's principal", async () => {
    const res = await upgrade(`sandboxd, sandboxd.key.${pro.key}`);
    expect(res.status).toBe(200);
    expect(((await res.json()) as { tenantId: string }).tenantId).toBe(pro.tenantId);
  });

  test("a wrong key is refused like a wrong header; the header, when sent, is the one used", async () => {
    await expect401(
      await upgrade("sandboxd, sandboxd.key.svc_pro_aaaaaaaaaaaa_bbbbbbbbbbbbbbbbbbbb"),
      INVALID,
    );
    await expect401(await upgrade(`sandboxd, sandboxd.key.${pro.key}`, "Bearer nope"), INVALID);
    await expect401(await upgrade(`sandboxd, sandboxd.key.${pro.key}`, "Basic x"), MISSING);
  });

  test("not an upgrade, or not the marker first: no key", async () => {
    const plain = await app.request("/auth/whoami", {
      headers: { "sec-websocket-protocol": `sandboxd, sandboxd.key.${pro.key}` },
    });
    await expect401(plain, MISSING);
    await expect401(await upgrade(`sandboxd.key.${pro.key}, sandboxd`), MISSING);
  });

  test("only exactly two protocols, the marker and a non-empty key", () => {
    const KEY = "svc_pro_abcdefghijkl_0123456789abcdefABCDEF";
    expect(keyFromWsProtocols("WebSocket", `sandboxd,sandboxd.key.${KEY}`)).toBe(KEY);
    const none = [
      [undefined, `sandboxd, sandboxd.key.${KEY}`],
      ["h2c", `sandboxd, sandboxd.key.${KEY}`],
      ["websocket", undefined],
      ["websocket", `sandboxd.key.${KEY}`],
      ["websocket", "sandboxd"],
      ["websocket", "sandboxd, sandboxd.key."],
      ["websocket", `sandboxd, other.${KEY}`],
      ["websocket", `sandboxd, sandboxd.key.${KEY}, x`],
    ] as const;
    for (const [u, p] of none) expect(keyFromWsProtocols(u, p)).toBeUndefined();
  });
});
