/**
 * Connect-url tokens (spec 4.2): an HMAC-SHA256 over (tenant, sandbox, port, protocol, expiry)
 * with a server secret. The token carries only the expiry and the MAC; the rest comes from the
 * request and the sandbox record, so a token is useless for any other sandbox, port or tenant.
 * Deleting the sandbox revokes its tokens: verification requires a live sandbox record.
 */
import { createHmac, timingSafeEqual } from "node:crypto";

function mac(
  secret: string,
  tenantId: string,
  sandboxId: string,
  port: number,
  protocol: string,
  exp: number,
) {
  return createHmac("sha256", secret)
    .update(`v1\n${tenantId}\n${sandboxId}\n${port}\n${protocol}\n${exp}`)
    .digest();
}

export function signConnectToken(
  secret: string,
  s: { tenantId: string; sandboxId: string; port: number; protocol: string; expSecs: number },
): string {
  return `${s.expSecs}.${mac(secret, s.tenantId, s.sandboxId, s.port, s.protocol, s.expSecs).toString("base64url")}`;
}

export function verifyConnectToken(
  secret: string,
  token: string,
  s: { tenantId: string; sandboxId: string; port: number; protocol: string; nowSecs: number },
): boolean {
  const m = /^(\d{1,12})\.([A-Za-z0-9_-]{43})$/.exec(token);
  if (!m) return false;
  const exp = Number(m[1]);
  const given = Buffer.from(m[2]!, "base64url");
  const want = mac(secret, s.tenantId, s.sandboxId, s.port, s.protocol, exp);
  return given.length === want.length && timingSafeEqual(given, want) && s.nowSecs < exp;
}
