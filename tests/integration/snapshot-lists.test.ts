/**
 * `GET /v1/snapshots` as a paged, filtered list (docs/lists.md, docs/snapshots.md) through the
 * real gateway app, with the in-memory agent keeping the snapshots, on PGlite and, where its
 * binaries are installed, PostgreSQL. Every answer is checked against openapi.yaml by the harness.
 * The SDKs and the CLI's `sbx snapshots` (in process, over HTTP) read it page by page.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { PassThrough } from "node:stream";
import { and, desc, eq, isNull } from "drizzle-orm";
import type { Ctx } from "../../cli/client/context.ts";
import { runClient } from "../../cli/client/index.ts";
import { snapshots } from "../../db/schema/snapshots.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { tenantIdOf } from "../../gateway/core/usage.ts";
import { Sandboxd } from "../../sdk/typescript/src/index.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";
import { databaseCases } from "../support/postgres-suite.ts";

const { cases } = databaseCases();
/** A migrating PGlite or a PostgreSQL start takes seconds on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field in the tests
type Body = Record<string, any>;

describe.each(cases)("the snapshots list ($name)", (db) => {
  let h: Harness;
  let pro: string;
  let otherPro: string;
  let srcA: string;
  let srcB: string;
  let foreignSrc: string;

  async function call(path: string, key: string, status = 200): Promise<Body> {
    const res = await h.req("GET", path, { key });
    const body = (await res.json()) as Body;
    if (res.status !== status) throw new Error(`GET ${path}: ${res.status} ${JSON.stringify(body)}`);
    return body;
  }
  async function sandbox(key: string, template = "python"): Promise<string> {
    const res = await h.req("POST", "/v1/sandboxes", { key, json: { template } });
    expect(res.status).toBe(201);
    return ((await res.json()) as Body).id as string;
  }
  async function take(src: string, labels: Record<string, string>, key = pro): Promise<string> {
    const res = await h.req("POST", `/v1/sandboxes/${src}/snapshots`, { key, json: { labels } });
    expect(res.status).toBe(201);
    return ((await res.json()) as Body).id as string;
  }
  /** The tenant's listed snapshots, newest first, read from the database. */
  async function ordered(tenant: string, labels: Record<string, string>): Promise<string[]> {
    const tenantId = (await tenantIdOf(h.handle.db, tenant)) ?? "none";
    const rows = await h.handle.db
      .select({ id: snapshots.id, labels: snapshots.labels })
      .from(snapshots)
      .where(and(eq(snapshots.tenantId, tenantId), isNull(snapshots.deletedAt)))
      .orderBy(desc(snapshots.createdAt), desc(snapshots.id));
    return rows.filter((r) => Object.entries(labels).every(([k, v]) => r.labels[k] === v)).map((r) => r.id);
  }

  beforeAll(async () => {
    h = await makeHarness(db.url ? { url: await db.url() } : {});
    pro = await h.key("acme", "pro");
    otherPro = await h.key("globex", "pro");
    // A second template, so that `template=` has something to tell apart.
    await upsertPublicTemplate(
      { db: h.handle.db, clock: () => h.now.ms },
      { id: "node", name: "Node", description: "Node.js" },
    );
    h.agent.addReadyTemplate("node");
    srcA = await sandbox(pro, "python");
    srcB = await sandbox(pro, "node");
    foreignSrc = await sandbox(otherPro, "python");
  }, TEST_TIMEOUT_MS);
  afterAll(() => h?.close());

  test(
    "pages of 3 over 8 snapshots, newest first, each once, while others are taken and one deleted",
    async () => {
      // Pairs taken in the same millisecond: the order between them is the id's.
      for (let i = 0; i < 8; i++) {
        if (i % 2 === 0) h.now.ms += 1000;
        await take(i % 2 === 0 ? srcA : srcB, { batch: "walk" });
      }
      // Another tenant's, with the same label, between them: never shown.
      await take(foreignSrc, { batch: "walk" }, otherPro);
      const before = await ordered("acme", { batch: "walk" });
      expect(before).toHaveLength(8);

      const seen: string[] = [];
      let deleted: string | undefined;
      let cursor: string | null = null;
      let pages = 0;
      do {
        const q: string = cursor === null ? "" : `&cursor=${cursor}`;
        const page = await call(`/v1/snapshots?label=batch:walk&limit=3${q}`, pro);
        expect(page.snapshots.length).toBeLessThanOrEqual(3);
        seen.push(...page.snapshots.map((s: Body) => s.id));
        cursor = page.next_cursor;
        pages++;
        // A snapshot taken between pages is newer than the walk's first row: it neither shows
        // nor shifts another row into a second page or out of all of them.
        h.now.ms += 1000;
        await take(srcA, { batch: "walk" });
        if (pages === 1) {
          // The row the cursor names is deleted: the next page still starts right after it.
          deleted = seen[seen.length - 1];
          expect((await h.req("DELETE", `/v1/snapshots/${deleted}`, { key: pro })).status).toBe(200);
        }
      } while (cursor !== null && pages < 20);

      expect(seen).toEqual(before);
      expect(new Set(seen).size).toBe(8);
      expect(seen).toContain(deleted as string);
      // 8 rows by 3: the third page holds the last two and says it is the last.
      expect(pages).toBe(3);
      // A fresh walk sees the 3 taken meanwhile, first, and not the deleted one.
      const now = await call("/v1/snapshots?label=batch:walk&limit=200", pro);
      expect(now.next_cursor).toBeNull();
      expect(now.snapshots.map((s: Body) => s.id)).toEqual(await ordered("acme", { batch: "walk" }));
      expect(now.snapshots).toHaveLength(10);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "filters: labels AND-ed, state, source_sandbox, template; another tenant's never",
    async () => {
      h.now.ms += 1000;
      const a1 = await take(srcA, { team: "red", app: "web" });
      h.now.ms += 1000;
      const a2 = await take(srcA, { team: "blue", app: "web" });
      h.now.ms += 1000;
      const b1 = await take(srcB, { team: "red", app: "api" });
      const foreign = await take(foreignSrc, { team: "red", app: "web" }, otherPro);
      // A failed one: the record as a failed take leaves it.
      h.now.ms += 1000;
      const failed = await take(srcB, { team: "red", app: "api" });
      await h.handle.db
        .update(snapshots)
        .set({ state: "failed", error: "the agent failed" })
        .where(eq(snapshots.id, failed));

      const ids = async (q: string) =>
        (await call(`/v1/snapshots?${q}`, pro)).snapshots.map((s: Body) => s.id as string);
      expect(await ids("label=team:red")).toEqual([failed, b1, a1]);
      expect(await ids("label=team:red&label=app:web")).toEqual([a1]);
      expect(await ids("label=app:web&label=team:red&label=app:web")).toEqual([a1]);
      expect(await ids("label=team:red&state=ready")).toEqual([b1, a1]);
      expect(await ids("label=team:red&state=failed")).toEqual([failed]);
      expect(await ids("label=team:red&state=lost")).toEqual([]);
      expect(await ids(`label=app:web&source_sandbox=${srcA}`)).toEqual([a2, a1]);
      expect(await ids(`label=team:red&template=node`)).toEqual([failed, b1]);
      expect(await ids("template=nothing-uses-this")).toEqual([]);
      // The other tenant sees its own only, and the source sandbox filter is no way in.
      const theirs = await call("/v1/snapshots?label=team:red&limit=200", otherPro);
      expect(theirs.snapshots.map((s: Body) => s.id)).toEqual([foreign]);
      expect(await ids(`source_sandbox=${foreignSrc}`)).toEqual([]);
      // Bad input is 400 before any SQL.
      for (const q of [
        "state=deleted",
        "limit=201",
        "limit=0",
        "label=nocolon",
        "label=team:a&label=team:b",
      ]) {
        expect((await h.req("GET", `/v1/snapshots?${q}`, { key: pro })).status).toBe(400);
      }
      // The default page is 50, as the other lists.
      expect((await call("/v1/snapshots", pro)).snapshots.length).toBeLessThanOrEqual(50);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a cursor altered, sent with other filters or by another tenant is 400",
    async () => {
      const first = await call("/v1/snapshots?label=batch:walk&limit=2", pro);
      const cursor = first.next_cursor as string;
      expect(typeof cursor).toBe("string");
      // Unaltered it works.
      expect(
        (await call(`/v1/snapshots?label=batch:walk&limit=2&cursor=${cursor}`, pro)).snapshots,
      ).toHaveLength(2);
      const [payload, sig] = cursor.split(".") as [string, string];
      const body = JSON.parse(Buffer.from(payload, "base64url").toString());
      body.t -= 1;
      const forged = `${Buffer.from(JSON.stringify(body)).toString("base64url")}.${sig}`;
      const altered = await call(`/v1/snapshots?label=batch:walk&cursor=${forged}`, pro, 400);
      expect(altered.message).toContain("invalid cursor: not one this service issued");
      const cut = await call(`/v1/snapshots?label=batch:walk&cursor=${cursor.slice(0, -3)}`, pro, 400);
      expect(cut.code).toBe("bad_request");
      const other = await call(`/v1/snapshots?label=batch:other&cursor=${cursor}`, pro, 400);
      expect(other.message).toContain("issued for other filters");
      await call(`/v1/snapshots?label=batch:walk&cursor=${cursor}`, otherPro, 400);
      // A sandboxes cursor is no snapshots cursor, with the same filters.
      for (let i = 0; i < 2; i++) {
        await h.req("POST", "/v1/sandboxes", {
          key: pro,
          json: { template: "python", labels: { batch: "walk" } },
        });
      }
      const sbx = await call("/v1/sandboxes?label=batch:walk&limit=1", pro);
      expect(typeof sbx.next_cursor).toBe("string");
      await call(`/v1/snapshots?label=batch:walk&cursor=${sbx.next_cursor}`, pro, 400);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "the TypeScript SDK follows every page with the filters",
    async () => {
      const c = new Sandboxd({
        baseUrl: "http://gateway.test",
        apiKey: pro,
        fetch: (url, init) => Promise.resolve(h.app.request(`${url.pathname}${url.search}`, init)),
      });
      const all = await c.snapshots.list({ labels: { batch: "walk" }, limit: 3 });
      expect(all.map((s) => s.id)).toEqual(await ordered("acme", { batch: "walk" }));
      const sizes: number[] = [];
      for await (const page of c.snapshots.pages({
        labels: { team: "red" },
        sourceSandbox: srcB,
        limit: 1,
      })) {
        sizes.push(page.items.length);
      }
      expect(sizes).toEqual([1, 1]);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "sbx snapshots (the CLI, over HTTP) follows next_cursor past the first page, or stops at --limit",
    async () => {
      // More than one page of the service's default (50 rows): the CLI must follow the cursor.
      const many: string[] = [];
      for (let i = 0; i < 52; i++) {
        many.push(await take(srcA, { batch: "many" }));
        // Spread over the harness's clock: the key's rate limit is 100 requests in any second.
        h.now.ms += 30;
      }
      const server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: (req) => h.app.fetch(req) });
      const sbx = async (...args: string[]) => {
        let out = "";
        let err = "";
        const writer = (add: (s: string) => void) =>
          ({
            write: (s: string) => {
              add(s);
              return true;
            },
          }) as unknown as Ctx["stdout"];
        const code = await runClient("sbx", args, {
          stdout: writer((s) => (out += s)),
          stderr: writer((s) => (err += s)),
          stdin: new PassThrough() as unknown as NodeJS.ReadStream,
          env: { SANDBOXD_URL: `http://127.0.0.1:${server.port}`, SANDBOXD_API_KEY: pro },
        });
        return { code, out, err };
      };
      try {
        const all = await sbx("snapshots", "--label", "batch:many", "--json");
        expect(all).toMatchObject({ code: 0, err: "" });
        const ids = (JSON.parse(all.out) as Body[]).map((x) => x.id);
        expect(ids).toEqual(await ordered("acme", { batch: "many" }));
        expect(ids).toHaveLength(52);
        const cut = await sbx("snapshots", "--label", "batch:many", "--limit", "7", "--json");
        expect((JSON.parse(cut.out) as Body[]).map((x) => x.id)).toEqual(ids.slice(0, 7));
        const table = await sbx("snapshots", "--label", "batch:many", "--sandbox", srcA, "--state", "ready");
        expect(table.out.trimEnd().split("\n")).toHaveLength(53);
        expect(table.out).toMatch(
          new RegExp(`^${ids[0]}\\s+-\\s+ready\\s+\\S+ \\w+\\s+${srcA}\\s+python\\s`, "m"),
        );
        const none = await sbx("snapshots", "--label", "batch:many", "--template", "node", "--json");
        expect(JSON.parse(none.out)).toEqual([]);
        const gone = await sbx("snapshot-rm", "snap_nosuchsnapshot");
        expect(gone).toMatchObject({ code: 1, out: "" });
        expect(gone.err).toMatch(/^not_found: /);
      } finally {
        await server.stop(true);
        for (const id of many) {
          await h.req("DELETE", `/v1/snapshots/${id}`, { key: pro });
          h.now.ms += 30;
        }
        // The next test starts with a fresh rate-limit window.
        h.now.ms += 1000;
      }
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "the Python SDK: list, page and pages over HTTP",
    async () => {
      const server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: (req) => h.app.fetch(req) });
      try {
        const script = `
import json, sys
from sandboxd import Sandboxd
c = Sandboxd(sys.argv[1], sys.argv[2])
out = {"all": [s["id"] for s in c.snapshots.list(labels={"batch": "walk"}, limit=3)]}
out["pages"] = [len(p.items) for p in c.snapshots.pages(labels={"team": "red"}, source_sandbox=sys.argv[3], limit=1)]
print(json.dumps(out))
`;
        // Not spawnSync: the gateway answering the script runs in this process's event loop.
        const p = Bun.spawn(
          ["/usr/bin/python3", "-c", script, `http://127.0.0.1:${server.port}`, pro, srcB],
          {
            env: { ...process.env, PYTHONPATH: join(import.meta.dir, "../../sdk/python") },
            stdout: "pipe",
            stderr: "pipe",
          },
        );
        const [stdout, stderr] = await Promise.all([
          new Response(p.stdout).text(),
          new Response(p.stderr).text(),
        ]);
        expect(stderr).toBe("");
        expect(await p.exited).toBe(0);
        const out = JSON.parse(stdout);
        expect(out.all).toEqual(await ordered("acme", { batch: "walk" }));
        expect(out.pages).toEqual([1, 1]);
      } finally {
        await server.stop(true);
      }
    },
    TEST_TIMEOUT_MS,
  );
});
