/**
 * Keyset pages over a table's (created_at, id), oldest first (or newest first with
 * `beforePosition`), with opaque cursors (docs/lists.md).
 * Any list of tenant rows can use it: the caller keeps its own tenant and filter conditions and
 * adds `afterPosition` and `limit + 1`; `pageOf` cuts the page and makes `next_cursor`.
 *
 * A cursor is `base64url(JSON {v, t, i, f}) "." base64url(MAC)`: `t` and `i` are the last row's
 * created_at (ms) and id, `f` a digest of the list's name and filters, and the MAC an
 * HMAC-SHA256 under a key derived from the key pepper (the same on every gateway of a database,
 * gateway/fleet-secrets.ts) over the owner (tenant and API) and the payload. So a cursor altered,
 * cut short or made for another tenant fails the MAC, one sent with other filters fails the
 * digest, and either is 400 `bad_request` before any SQL runs. The tenant's own condition applies
 * to every page whatever the cursor says, so even a forged one could only move within the
 * caller's rows.
 */
import { createHash, createHmac, timingSafeEqual } from "node:crypto";
import { type Column, type SQL, sql } from "drizzle-orm";
import { SandboxdError } from "../../contracts/errors.ts";

/** Where a page ended: the last row's created_at and id. */
export interface Position {
  at: Date;
  id: string;
}

/** What a cursor is bound to: who lists (tenant and API) and which list with which filters. */
export interface CursorScope {
  /** The caller, e.g. `${tenantId}/${api}`: a cursor made for another owner fails its MAC. */
  owner: string;
  /** `filtersDigest(list, filters)` of the request. */
  digest: string;
}

/** The MAC key, apart from the pepper's other use (key hashes) by its own label. */
const KEY_LABEL = "sandboxd list cursor v1";
const VERSION = 1;
/** 128 bits of MAC: forging one is out of reach; the full 256 would only lengthen the cursor. */
const MAC_BYTES = 16;
/** The longest id a position may name: every id of ours is a prefix and 20 characters. */
const MAX_ID_CHARS = 64;

export function cursorKey(pepper: string): Buffer {
  return createHmac("sha256", pepper).update(KEY_LABEL).digest();
}

/**
 * A digest of a list's name and its filters, independent of their order in the query: absent
 * ones dropped, keys sorted, arrays sorted. `limit` is not a filter (pages may change size).
 */
export function filtersDigest(list: string, filters: Record<string, string | string[] | undefined>): string {
  const canonical: [string, string | string[]][] = [];
  for (const k of Object.keys(filters).sort()) {
    const v = filters[k];
    if (v === undefined || (Array.isArray(v) && v.length === 0)) continue;
    canonical.push([k, Array.isArray(v) ? [...v].sort() : v]);
  }
  return createHash("sha256")
    .update(JSON.stringify([list, canonical]))
    .digest("base64url")
    .slice(0, 16);
}

function mac(key: Buffer, owner: string, payload: string): Buffer {
  return createHmac("sha256", key).update(`${owner}\n${payload}`).digest().subarray(0, MAC_BYTES);
}

export function encodeCursor(key: Buffer, scope: CursorScope, pos: Position): string {
  const payload = Buffer.from(
    JSON.stringify({ v: VERSION, t: pos.at.getTime(), i: pos.id, f: scope.digest }),
  ).toString("base64url");
  return `${payload}.${mac(key, scope.owner, payload).toString("base64url")}`;
}

const RESTART = "start again without `cursor`";

/** The position a cursor names, or 400 `bad_request` saying why it cannot be used here. */
export function decodeCursor(key: Buffer, scope: CursorScope, cursor: string): Position {
  const invalid = () =>
    new SandboxdError(
      "bad_request",
      `invalid cursor: not one this service issued to this caller (altered, cut short or another tenant's); ${RESTART}`,
    );
  const [payload, sig, extra] = cursor.split(".");
  if (payload === undefined || sig === undefined || extra !== undefined) throw invalid();
  const given = Buffer.from(sig, "base64url");
  const want = mac(key, scope.owner, payload);
  if (given.length !== want.length || !timingSafeEqual(given, want)) throw invalid();
  // Past the MAC the payload is ours; its shape is still checked rather than trusted blindly.
  let body: unknown;
  try {
    body = JSON.parse(Buffer.from(payload, "base64url").toString("utf8"));
  } catch {
    throw invalid();
  }
  const b = body as { v?: unknown; t?: unknown; i?: unknown; f?: unknown };
  if (
    b.v !== VERSION ||
    typeof b.t !== "number" ||
    !Number.isSafeInteger(b.t) ||
    typeof b.i !== "string" ||
    b.i.length === 0 ||
    b.i.length > MAX_ID_CHARS ||
    typeof b.f !== "string"
  ) {
    throw invalid();
  }
  if (b.f !== scope.digest) {
    throw new SandboxdError(
      "bad_request",
      `invalid cursor: it was issued for other filters; send the filters of the request that returned it, or ${RESTART}`,
    );
  }
  return { at: new Date(b.t), id: b.i };
}

/**
 * Rows after `pos` in (created_at, id) order: one row comparison, which the (tenant, api,
 * created_at, id) index serves as a range. Millisecond positions are exact: created_at is always
 * written from the gateway's clock (a JavaScript Date), never with finer digits.
 */
export function afterPosition(createdAt: Column, id: Column, pos: Position): SQL {
  return sql`(${createdAt}, ${id}) > (${pos.at.toISOString()}::timestamptz, ${pos.id})`;
}

/**
 * Rows before `pos` in (created_at, id) order, for a list read newest first (the snapshots list):
 * the same range read backwards on the same index.
 */
export function beforePosition(createdAt: Column, id: Column, pos: Position): SQL {
  return sql`(${createdAt}, ${id}) < (${pos.at.toISOString()}::timestamptz, ${pos.id})`;
}

/**
 * The page out of `rows` read with `limit + 1`: the extra row only says another page exists, so
 * `next` is null exactly when this page is the last.
 */
export function pageOf<T>(
  rows: T[],
  limit: number,
  position: (row: T) => Position,
  encode: (pos: Position) => string,
): { rows: T[]; next: string | null } {
  if (rows.length <= limit) return { rows, next: null };
  const page = rows.slice(0, limit);
  const last = page[page.length - 1] as T;
  return { rows: page, next: encode(position(last)) };
}
