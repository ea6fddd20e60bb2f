/**
 * Filtered, paged lists (docs/lists.md) through the real gateway app: `GET /v1/sandboxes` and
 * `GET /v1/sessions` with the in-memory agent, on PGlite and, where its binaries are installed,
 * PostgreSQL. Every answer is checked against openapi.yaml by the harness.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { and, eq } from "drizzle-orm";
import { MAX_LABEL_FILTERS, MAX_LIST_LIMIT } from "../../contracts/api/limits.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { tenantIdOf } from "../../gateway/core/usage.ts";
import { Sandboxd, SandboxdError } from "../../sdk/typescript/src/index.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";
import { databaseCases } from "../support/postgres-suite.ts";

const { cases } = databaseCases();
/** A migrating PGlite or a PostgreSQL start takes seconds on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field in the tests
type Body = Record<string, any>;

describe.each(cases)("paged lists ($name)", (db) => {
  let h: Harness;
  let pro: string;
  let otherPro: string;
  let live: string;

  beforeAll(async () => {
    h = await makeHarness(db.url ? { url: await db.url() } : {});
    pro = await h.key("acme", "pro");
    otherPro = await h.key("globex", "pro");
    live = await h.key("acme", "live");
  }, TEST_TIMEOUT_MS);
  afterAll(() => h?.close());

  async function call(path: string, key: string, status = 200): Promise<Body> {
    const res = await h.req("GET", path, { key });
    const body = (await res.json()) as Body;
    if (res.status !== status) throw new Error(`GET ${path}: ${res.status} ${JSON.stringify(body)}`);
    return body;
  }
  async function create(key: string, labels: Record<string, string> = {}): Promise<string> {
    const res = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python", labels } });
    expect(res.status).toBe(201);
    return ((await res.json()) as Body).id as string;
  }
  /** The tenant's live sandboxes in the list's order, read from the database. */
  async function ordered(tenant: string): Promise<string[]> {
    const tenantId = (await tenantIdOf(h.handle.db, tenant)) ?? "none";
    const rows = await h.handle.db
      .select({ id: sandboxes.id, at: sandboxes.createdAt, state: sandboxes.state })
      .from(sandboxes)
      .where(and(eq(sandboxes.tenantId, tenantId), eq(sandboxes.api, "sandboxes")))
      .orderBy(sandboxes.createdAt, sandboxes.id);
    return rows.filter((r) => r.state === "running" || r.state === "suspended").map((r) => r.id);
  }

  test(
    "pages of 3 over 10 sandboxes cover each once, in order, while others are created and one deleted",
    async () => {
      // Pairs created in the same millisecond: the order between them is the id's.
      for (let i = 0; i < 10; i++) {
        if (i % 2 === 0) h.now.ms += 1000;
        await create(pro, { batch: "walk" });
      }
      const before = await ordered("acme");
      expect(before).toHaveLength(10);

      const seen: string[] = [];
      const made: string[] = [];
      let deleted: string | undefined;
      let cursor: string | null = null;
      let pages = 0;
      do {
        const q: string = cursor === null ? "" : `&cursor=${cursor}`;
        const page = await call(`/v1/sandboxes?label=batch:walk&limit=3${q}`, pro);
        expect(page.sandboxes.length).toBeLessThanOrEqual(3);
        for (const s of page.sandboxes) {
          expect(s).toEqual({ id: s.id, template: "python", state: "running" });
          seen.push(s.id);
        }
        cursor = page.next_cursor;
        pages++;
        if (pages <= 3) {
          // A new sandbox between pages: later than every cursor, so the walk reaches it.
          h.now.ms += 1000;
          made.push(await create(pro, { batch: "walk" }));
        }
        if (pages === 1) {
          // The row the cursor names is deleted: the next page still starts right after it.
          deleted = seen[seen.length - 1];
          expect((await h.req("DELETE", `/v1/sandboxes/${deleted}`, { key: pro })).status).toBe(200);
        }
      } while (cursor !== null && pages < 20);

      expect(new Set(seen).size).toBe(seen.length);
      expect(seen).toEqual([...before, ...made]);
      expect(seen).toContain(deleted as string);
      // 13 rows by 3: the fifth page holds the last one and says it is the last.
      expect(pages).toBe(5);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "label filters are AND-ed, with state and template; no filter lists everything live",
    async () => {
      // A second apart, so the list's order is the order of creation.
      const later = () => {
        h.now.ms += 1000;
      };
      later();
      const a = await create(pro, { team: "a", env: "prod", url: "http://x:1" });
      later();
      const b = await create(pro, { team: "a", env: "dev" });
      later();
      const c = await create(pro, { team: "b", env: "prod" });
      const ids = (p: Body) => p.sandboxes.map((s: Body) => s.id);

      expect(ids(await call("/v1/sandboxes?label=team:a", pro))).toEqual([a, b]);
      expect(ids(await call("/v1/sandboxes?label=team:a&label=env:prod", pro))).toEqual([a]);
      expect(ids(await call("/v1/sandboxes?label=env:prod&label=team:a", pro))).toEqual([a]);
      expect(ids(await call("/v1/sandboxes?label=env:prod", pro))).toEqual([a, c]);
      // The value is everything after the first ':' (and may hold more of them).
      expect(ids(await call(`/v1/sandboxes?label=${encodeURIComponent("url:http://x:1")}`, pro))).toEqual([
        a,
      ]);
      expect(ids(await call("/v1/sandboxes?label=team:c", pro))).toEqual([]);
      // The same pair twice is one filter.
      expect(ids(await call("/v1/sandboxes?label=team:b&label=team:b", pro))).toEqual([c]);

      expect((await h.req("POST", `/v1/sandboxes/${b}/suspend`, { key: pro })).status).toBe(200);
      expect(await call("/v1/sandboxes?label=team:a&state=suspended", pro)).toEqual({
        sandboxes: [{ id: b, template: "python", state: "suspended" }],
        next_cursor: null,
      });
      expect(ids(await call("/v1/sandboxes?label=team:a&state=running", pro))).toEqual([a]);
      expect(ids(await call("/v1/sandboxes?label=team:a&template=python", pro))).toEqual([a, b]);
      // An unknown template id matches nothing (a filter, not a lookup).
      expect(ids(await call("/v1/sandboxes?template=nope", pro))).toEqual([]);

      const all = await call("/v1/sandboxes", pro);
      expect(ids(all)).toEqual(await ordered("acme"));
      expect(all.next_cursor).toBeNull();
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "another tenant's rows, cursors and API never show",
    async () => {
      const theirs = await create(otherPro, { team: "a" });
      const mine = await call("/v1/sandboxes?limit=2", pro);
      expect(mine.next_cursor).toEqual(expect.any(String));
      const listed = (await call(`/v1/sandboxes?limit=${MAX_LIST_LIMIT}`, pro)).sandboxes.map(
        (s: Body) => s.id,
      );
      expect(listed).not.toContain(theirs);
      expect(listed).toEqual(await ordered("acme"));
      expect((await call("/v1/sandboxes?label=team:a", otherPro)).sandboxes).toEqual([
        { id: theirs, template: "python", state: "running" },
      ]);

      // Acme's cursor with globex's key: refused, not a page of either tenant.
      const foreign = await call(`/v1/sandboxes?limit=2&cursor=${mine.next_cursor}`, otherPro, 400);
      expect(foreign.code).toBe("bad_request");
      expect(foreign.message).toContain("another tenant's");
      // A sandboxes cursor on the sessions list of the same tenant: another owner too.
      const session = await call(`/v1/sessions?cursor=${mine.next_cursor}`, live, 400);
      expect(session.code).toBe("bad_request");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a tampered, forged, foreign-filter or garbage cursor and hostile filters are 400 bad_request",
    async () => {
      const page = await call("/v1/sandboxes?label=batch:walk&limit=2", pro);
      const cursor = page.next_cursor as string;
      const [payload, mac] = cursor.split(".") as [string, string];

      // Moved to another position with the MAC kept: the MAC no longer fits.
      const fields = JSON.parse(Buffer.from(payload, "base64url").toString());
      const moved = Buffer.from(JSON.stringify({ ...fields, t: 0 })).toString("base64url");
      const flipped = `${payload.slice(0, -1)}${payload.endsWith("A") ? "B" : "A"}.${mac}`;
      for (const bad of [`${moved}.${mac}`, flipped, `${payload}.${mac}x`, payload, "abc", `${cursor}.x`]) {
        const r = await call(`/v1/sandboxes?label=batch:walk&limit=2&cursor=${bad}`, pro, 400);
        expect(r.code).toBe("bad_request");
        expect(r.message).toContain("invalid cursor");
      }
      // The right cursor with other filters (or none).
      for (const q of ["label=batch:other", "", "label=batch:walk&state=running", "template=python"]) {
        const r = await call(`/v1/sandboxes?${q}&cursor=${cursor}`, pro, 400);
        expect(r.message).toContain("other filters");
      }
      // The same filters in another order, and another page size, are the same list.
      expect(
        (await call(`/v1/sandboxes?limit=5&cursor=${cursor}&label=batch:walk`, pro)).sandboxes.length,
      ).toBe(5);

      const tooMany = Array.from({ length: MAX_LABEL_FILTERS + 1 }, (_, i) => `label=k${i}:v`).join("&");
      const hostile = [
        "limit=0",
        `limit=${MAX_LIST_LIMIT + 1}`,
        "limit=99999999999",
        "limit=abc",
        "limit=-1",
        "state=destroyed",
        "state=starting",
        "template=a%20b",
        "label=novalue",
        "label=:v",
        `label=${"k".repeat(64)}:v`,
        `label=k:${"v".repeat(257)}`,
        "label=team:a&label=team:b",
        tooMany,
        "cursor=",
        `cursor=${"A".repeat(513)}`,
        "cursor=%27%3B%20drop%20table%20sandboxes",
      ];
      for (const q of hostile) {
        const r = await call(`/v1/sandboxes?${q}`, pro, 400);
        expect(r.code).toBe("bad_request");
        expect(r.message.length).toBeGreaterThan(0);
      }
      // Still there: nothing above reached the database as SQL.
      expect((await call("/v1/sandboxes", pro)).sandboxes.length).toBeGreaterThan(0);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "sessions: pages and the template filter",
    async () => {
      const made: string[] = [];
      for (let i = 0; i < 5; i++) {
        h.now.ms += 1000;
        const res = await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "python" } });
        expect(res.status).toBe(201);
        made.push(((await res.json()) as Body).session_id);
      }
      const seen: string[] = [];
      let cursor: string | null = null;
      do {
        const q: string = cursor === null ? "" : `&cursor=${cursor}`;
        const page = await call(`/v1/sessions?limit=2&template_id=python${q}`, live);
        for (const s of page.sessions) seen.push(s.session_id);
        cursor = page.next_cursor;
      } while (cursor !== null);
      expect(seen).toEqual(made);
      expect((await call("/v1/sessions?template_id=other", live)).sessions).toEqual([]);
      expect((await call("/v1/sessions?limit=201", live, 400)).code).toBe("bad_request");
    },
    TEST_TIMEOUT_MS,
  );
});

/**
 * The SDKs' lists against the real gateway app: TypeScript through its `fetch` option, Python over
 * HTTP (the app served by Bun.serve on a loopback port) as a separate python3 process.
 */
describe("the SDKs' lists and page iterators", () => {
  let h: Harness;
  let pro: string;
  let server: ReturnType<typeof Bun.serve> | undefined;
  const made: string[] = [];

  beforeAll(async () => {
    h = await makeHarness();
    pro = await h.key("acme", "pro");
    for (let i = 0; i < 7; i++) {
      h.now.ms += 1000;
      const res = await h.req("POST", "/v1/sandboxes", {
        key: pro,
        json: { template: "python", labels: { team: i % 2 === 0 ? "even" : "odd", app: "web" } },
      });
      made.push(((await res.json()) as Body).id);
    }
    server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: (req) => h.app.fetch(req) });
  }, TEST_TIMEOUT_MS);
  afterAll(async () => {
    await server?.stop(true);
    await h?.close();
  });

  const even = () => made.filter((_, i) => i % 2 === 0);

  test("TypeScript: list follows every page; pages yields them in order with the filters", async () => {
    const c = new Sandboxd({
      baseUrl: "http://gateway.test",
      apiKey: pro,
      fetch: (url, init) => Promise.resolve(h.app.request(`${url.pathname}${url.search}`, init)),
    });
    expect((await c.sandboxes.list({ limit: 2 })).map((s) => s.id)).toEqual(made);
    const sizes: number[] = [];
    const ids: string[] = [];
    for await (const page of c.sandboxes.pages({ labels: { team: "even", app: "web" }, limit: 3 })) {
      sizes.push(page.items.length);
      ids.push(...page.items.map((s) => s.id));
    }
    expect(sizes).toEqual([3, 1]);
    expect(ids).toEqual(even());
    expect(await c.sandboxes.list({ state: "suspended" })).toEqual([]);
    const bad = await c.sandboxes.list({ limit: 500 }).catch((e: unknown) => e);
    expect(bad).toBeInstanceOf(SandboxdError);
    expect((bad as SandboxdError).code).toBe("bad_request");
  });

  test(
    "Python: list, page and pages against the gateway over HTTP",
    async () => {
      const script = `
import json, sys
from sandboxd import Sandboxd, BadRequestError
c = Sandboxd(sys.argv[1], sys.argv[2])
out = {"all": [s.id for s in c.sandboxes.list(limit=2)]}
out["pages"] = [[s.id for s in p.items] for p in c.sandboxes.pages(labels={"team": "even", "app": "web"}, limit=3)]
first = c.sandboxes.page(limit=4)
out["next"] = [s.id for s in c.sandboxes.page(limit=4, cursor=first.next_cursor).items]
try:
    c.sandboxes.page(labels={"team": "odd"}, cursor=first.next_cursor)
except BadRequestError as e:
    out["other_filters"] = e.code
print(json.dumps(out))
`;
      // Not spawnSync: the gateway answering the script runs in this process's event loop.
      // Debian's python3, which bin/sandboxd installs for the tests (TEST_PKGS).
      const p = Bun.spawn(["/usr/bin/python3", "-c", script, `http://127.0.0.1:${server?.port}`, pro], {
        env: { ...process.env, PYTHONPATH: join(import.meta.dir, "../../sdk/python") },
        stdout: "pipe",
        stderr: "pipe",
      });
      const [stdout, stderr] = await Promise.all([
        new Response(p.stdout).text(),
        new Response(p.stderr).text(),
      ]);
      expect(stderr).toBe("");
      expect(await p.exited).toBe(0);
      const out = JSON.parse(stdout);
      expect(out.all).toEqual(made);
      expect(out.pages).toEqual([even().slice(0, 3), even().slice(3)]);
      expect(out.next).toEqual(made.slice(4));
      expect(out.other_filters).toBe("bad_request");
    },
    TEST_TIMEOUT_MS,
  );
});
