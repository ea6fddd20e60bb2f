/**
 * Connect tokens on their own: a token names its tenant only for the exact sandbox, port and
 * protocol it was minted for, before its expiry, under the secret that signed it. The route that
 * mints and the one that accepts them are tested through the app (tests/integration/gateway-api.test.ts).
 */
import { expect, test } from "bun:test";
import { createHmac } from "node:crypto";
import { decodeJwt, decodeProtectedHeader, SignJWT } from "jose";
import { connectTokenRegion } from "../../contracts/api/connect-region.ts";
import type { TunnelProtocol } from "../../contracts/api/sandboxes-api.ts";
import {
  CONNECT_AUDIENCE,
  signConnectToken,
  verifyConnectToken,
  verifyConnectTokenClaims,
} from "./connect-token.ts";

const SECRET = "connect-test-secret-0123";
const NOW_SECS = 1_740_830_400;
const scope = {
  tenantId: "ten_1",
  keyId: "k1",
  sandboxId: "sbx_1",
  port: 8080,
  protocol: "tcp" as TunnelProtocol,
};
const want = { sandboxId: "sbx_1", port: 8080, protocol: "tcp" as TunnelProtocol, nowMs: NOW_SECS * 1000 };

function mint(over: Partial<typeof scope> = {}, ttl = 60): Promise<string> {
  return signConnectToken(SECRET, { ...scope, ...over, nowSecs: NOW_SECS, expSecs: NOW_SECS + ttl });
}

test("a genuine token names its tenant; the claims are the scope", async () => {
  const t = await mint();
  expect(await verifyConnectToken(SECRET, t, want)).toBe("ten_1");
  expect(decodeProtectedHeader(t)).toEqual({ alg: "HS256", typ: "JWT" });
  expect(decodeJwt(t)).toEqual({
    tid: "ten_1",
    port: 8080,
    proto: "tcp",
    kid: "k1",
    aud: CONNECT_AUDIENCE,
    sub: "sbx_1",
    iat: NOW_SECS,
    exp: NOW_SECS + 60,
  });
});

test("a tenant's home region rides in `reg`, readable without the secret, bound by the signature", async () => {
  const t = await signConnectToken(SECRET, {
    ...scope,
    nowSecs: NOW_SECS,
    expSecs: NOW_SECS + 60,
    region: "eu_west.1",
  });
  expect(decodeJwt(t).reg).toBe("eu_west.1");
  expect(connectTokenRegion(t)).toBe("eu_west.1");
  expect(await verifyConnectToken(SECRET, t, want)).toBe("ten_1");
  // Another region in the claims, the signature kept: refused.
  const [h, , sig] = t.split(".");
  const forged = btoa(JSON.stringify({ ...decodeJwt(t), reg: "us" })).replace(/=+$/, "");
  expect(connectTokenRegion(`${h}.${forged}.${sig}`)).toBe("us");
  expect(await verifyConnectToken(SECRET, `${h}.${forged}.${sig}`, want)).toBeUndefined();
  // No region (a tenant without a home), or not a token: nothing to route by.
  expect(connectTokenRegion(await mint())).toBeUndefined();
  for (const bad of ["", "a.b", "a.!!!.c", `${h}.${btoa("[1]")}.${sig}`, `${t}${"x".repeat(2048)}`])
    expect(connectTokenRegion(bad)).toBeUndefined();
});

test("any other sandbox, port or protocol is refused", async () => {
  const t = await mint();
  expect(await verifyConnectToken(SECRET, t, { ...want, sandboxId: "sbx_2" })).toBeUndefined();
  expect(await verifyConnectToken(SECRET, t, { ...want, port: 8081 })).toBeUndefined();
  expect(await verifyConnectToken(SECRET, t, { ...want, protocol: "cdp" })).toBeUndefined();
  const cdp = await mint({ protocol: "cdp" });
  expect(await verifyConnectToken(SECRET, cdp, { ...want, protocol: "cdp" })).toBe("ten_1");
});

test("valid until its expiry, not at it", async () => {
  const t = await mint({}, 30);
  expect(await verifyConnectToken(SECRET, t, { ...want, nowMs: (NOW_SECS + 29) * 1000 })).toBe("ten_1");
  expect(await verifyConnectToken(SECRET, t, { ...want, nowMs: (NOW_SECS + 30) * 1000 })).toBeUndefined();
});

test("another secret, a changed payload or not a token at all is refused", async () => {
  const t = await mint();
  expect(await verifyConnectToken("another-secret-0123456789", t, want)).toBeUndefined();
  const [h, , s] = t.split(".");
  const forged = Buffer.from(JSON.stringify({ ...decodeJwt(t), tid: "ten_2" })).toString("base64url");
  expect(await verifyConnectToken(SECRET, `${h}.${forged}.${s}`, want)).toBeUndefined();
  const none = Buffer.from(JSON.stringify({ alg: "none", typ: "JWT" })).toString("base64url");
  expect(await verifyConnectToken(SECRET, `${none}.${t.split(".")[1]}.`, want)).toBeUndefined();
  for (const junk of ["", "x", "a.b.c"]) expect(await verifyConnectToken(SECRET, junk, want)).toBeUndefined();
});

test("a token names its minting key (claim `kid`); one without it is refused", async () => {
  const t = await mint();
  expect(decodeJwt(t).kid).toBe("k1");
  expect(await verifyConnectTokenClaims(SECRET, t, want)).toEqual({ tenantId: "ten_1", keyId: "k1" });
  // The same claims signed with the same secret, but no `kid`: not a token this gateway mints,
  // and one whose revocation could not be checked.
  const noKid = await new SignJWT({ tid: "ten_1", port: 8080, proto: "tcp" })
    .setProtectedHeader({ alg: "HS256", typ: "JWT" })
    .setAudience(CONNECT_AUDIENCE)
    .setSubject("sbx_1")
    .setIssuedAt(NOW_SECS)
    .setExpirationTime(NOW_SECS + 60)
    .sign(new Uint8Array(createHmac("sha256", SECRET).update("sandboxd connect-token v1").digest()));
  expect(await verifyConnectTokenClaims(SECRET, noKid, want)).toBeUndefined();
});
