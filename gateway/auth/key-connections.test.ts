/**
 * The registry of connections by key alone, over a real PGlite db with keys issued by keys.ts:
 * removals leave it empty (and its timer stopped); `revoke` ends only that key's; `check` ends
 * the connections of a key revoked or deleted behind its back, by the periodic timer too, and
 * keeps them all while the database cannot answer. Through the gateway:
 * tests/integration/gateway-key-revoke.test.ts.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { type DbHandle, openDb } from "../../db/client.ts";
import { apiKeys } from "../../db/schema/api-keys.ts";
import { KEY_REVOKED_CLOSE, KEY_REVOKED_REASON, KeyConnections } from "./key-connections.ts";
import { createKey, revokeKey } from "./keys.ts";

const PEPPER = "key-connections-pepper-0123";
let dir: string;
let handle: DbHandle;

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "sandboxd-keyconn-"));
  handle = await openDb({ dataDir: dir });
});
afterAll(async () => {
  await handle.close();
  rmSync(dir, { recursive: true, force: true });
});

/** A connection that records how it was ended. */
function conn() {
  const c = {
    ended: [] as Array<[number, string]>,
    close: (code: number, reason: string) => c.ended.push([code, reason]),
  };
  return c;
}

const newKey = async () => (await createKey(handle.db, PEPPER, { tenant: "acme", tier: "pro" })).keyId;

test("removals leave nothing behind; revoke ends that key's connections only", async () => {
  const [a, b] = [await newKey(), await newKey()];
  const reg = new KeyConnections({ db: handle.db, recheckMs: 600_000 });
  const [a1, a2, b1] = [conn(), conn(), conn()];
  const offA1 = reg.add(a, a1);
  reg.add(a, a2);
  const offB1 = reg.add(b, b1);
  expect([reg.count(a), reg.count(b), reg.count()]).toEqual([2, 1, 3]);
  offA1();
  offA1(); // idempotent
  expect(reg.count(a)).toBe(1);
  expect(reg.revoke(a)).toBe(1);
  expect(a2.ended).toEqual([[KEY_REVOKED_CLOSE, KEY_REVOKED_REASON]]);
  expect(a1.ended).toEqual([]);
  expect(b1.ended).toEqual([]);
  offB1();
  expect(reg.count()).toBe(0);
  // Its timer went with the last connection: a check now reads nothing.
  const checks = reg.checks;
  await reg.check();
  expect(reg.checks).toBe(checks);
});

test("check ends the connections of keys revoked or deleted elsewhere; the timer runs it alone", async () => {
  const [a, b, c] = [await newKey(), await newKey(), await newKey()];
  const reg = new KeyConnections({ db: handle.db, recheckMs: 600_000 });
  const [ca, cb, cc] = [conn(), conn(), conn()];
  reg.add(a, ca);
  reg.add(b, cb);
  reg.add(c, cc);
  await revokeKey(handle.db, a);
  await handle.db.delete(apiKeys).where(eq(apiKeys.id, b));
  // Two calls while one is in flight: one read and one more after it, not two in parallel.
  const before = reg.checks;
  await Promise.all([reg.check(), reg.check()]);
  expect(reg.checks - before).toBe(2);
  expect(ca.ended).toEqual([[KEY_REVOKED_CLOSE, KEY_REVOKED_REASON]]);
  expect(cb.ended).toEqual([[KEY_REVOKED_CLOSE, KEY_REVOKED_REASON]]);
  expect(cc.ended).toEqual([]);
  expect(reg.count()).toBe(1);
  reg.stop();

  // Nobody calls check: the periodic one finds the revocation.
  const timed = new KeyConnections({ db: handle.db, recheckMs: 50 });
  const cd = conn();
  timed.add(c, cd);
  await revokeKey(handle.db, c);
  const t0 = performance.now();
  while (cd.ended.length === 0 && performance.now() - t0 < 5_000) await Bun.sleep(10);
  expect(cd.ended).toEqual([[KEY_REVOKED_CLOSE, KEY_REVOKED_REASON]]);
  expect(timed.count()).toBe(0);
});

test("a database that cannot answer keeps every connection and says so", async () => {
  const a = await newKey();
  const lines: string[] = [];
  // A real database, closed: every query fails as one gone away does.
  const goneDir = mkdtempSync(join(tmpdir(), "sandboxd-keyconn-gone-"));
  const gone = await openDb({ dataDir: goneDir });
  await gone.close();
  const reg = new KeyConnections({ db: gone.db, recheckMs: 600_000, log: (l) => lines.push(l) });
  const ca = conn();
  reg.add(a, ca);
  await reg.check();
  expect(ca.ended).toEqual([]);
  expect(reg.count(a)).toBe(1);
  expect(lines.join("\n")).toContain("checking the keys of open connections failed: ");
  expect(lines).toHaveLength(1);
  reg.stop();
  rmSync(goneDir, { recursive: true, force: true });
});
