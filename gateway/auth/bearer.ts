/**
 * The API-key middleware (spec 5): `Authorization: Bearer <key>` resolved to the key's principal
 * (tenant, key id, tier, family), which handlers read with `c.get("principal")`. A missing or
 * malformed header and a key that does not verify (unknown, wrong secret, revoked, another tier)
 * are both 401 `unauthorized`, thrown so that the one error mapping (gateway/errors.ts) answers;
 * the message tells the two apart but never says why a key was refused.
 */
import { createMiddleware } from "hono/factory";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import type { HonoEnv } from "../deps.ts";
import { verifyKey } from "./keys.ts";

/** The scheme is case-insensitive (RFC 9110 11.1); the key is one token, trailing blanks allowed. */
const BEARER = /^Bearer\s+(\S+)\s*$/i;

export function bearerKey(opts: { db: Db; pepper: string }) {
  return createMiddleware<HonoEnv>(async (c, next) => {
    const header = c.req.header("authorization");
    const m = header === undefined ? null : BEARER.exec(header);
    if (!m) throw new SandboxdError("unauthorized", "missing API key: send Authorization: Bearer <key>");
    const principal = await verifyKey(opts.db, opts.pepper, m[1]!);
    if (!principal) throw new SandboxdError("unauthorized", "invalid API key");
    c.set("principal", principal);
    await next();
  });
}
