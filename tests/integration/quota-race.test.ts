/**
 * Quotas hold under concurrency: N requests racing for k free places of one tenant end with
 * exactly k successes and N-k 429 `quota_exceeded`, for every quota the gateway checks (running
 * sandboxes and sessions on create and resume, suspended sandboxes, templates on bake and upload).
 * Each check-and-reserve runs under the tenant's lock (gateway/core/tenant-lock.ts), against
 * PGlite and a real PostgreSQL (skipped, with a message, only when the postgres binaries are
 * absent).
 *
 * Through the gateway app (`app.request`) with the real database; the agent is the in-memory
 * stand-in, each of its VM and build calls made to take `AGENT_MS` as a real agent's take
 * seconds: the window in which, without the lock, every racer counted before any of them
 * recorded its change (every racer succeeded). The rule under test is the gateway's alone.
 */
import { afterAll, describe, expect, test } from "bun:test";
import { eq, isNotNull } from "drizzle-orm";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";
import { onPostgres } from "../support/postgres-suite.ts";

/** What each stand-in agent call takes, ms: far longer than the gateway's own db round trips. */
const AGENT_MS = 40;
/**
 * Per tier, chosen so that each race has more racers than places: pro (creates, resumes) runs 2
 * and keeps 6 suspended; enterprise (suspends) runs 10 and keeps 3 suspended.
 */
const RUNNING = { pro: 2, enterprise: 10 };
const SUSPENDED = { pro: 6, enterprise: 3 };
const TEMPLATE_CAP = 2;
const SESSION_CAP = 3;

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field
type Body = Record<string, any>;

async function slowHarness(url?: string): Promise<Harness> {
  const h = await makeHarness({
    ...(url !== undefined ? { url } : {}),
    limits: {
      sandboxQuotaByTier: { live: 0, scale: 0, demo: 0, ...RUNNING },
      suspendedQuotaByTier: { live: 0, scale: 0, demo: 0, ...SUSPENDED },
      templateQuotaByTier: { live: 0, scale: TEMPLATE_CAP, demo: 0, pro: TEMPLATE_CAP, enterprise: 0 },
      sessionCapPerTenant: SESSION_CAP,
    },
  });
  const a = h.agent;
  for (const name of ["createSandbox", "suspend", "resume", "buildTemplate"] as const) {
    const call = (a[name] as (...args: unknown[]) => Promise<unknown>).bind(a);
    (a as unknown as Record<string, unknown>)[name] = async (...args: unknown[]) => {
      await Bun.sleep(AGENT_MS);
      return call(...args);
    };
  }
  return h;
}

/** Runs the requests at once: how many succeeded, and the others' statuses and codes, sorted. */
async function race(reqs: (() => Promise<Response>)[]): Promise<{ ok: number; codes: string[] }> {
  const res = await Promise.all(reqs.map((r) => r()));
  let ok = 0;
  const codes: string[] = [];
  for (const r of res) {
    const body = (await r.json()) as Body;
    if (r.status < 300) ok++;
    else codes.push(`${r.status} ${body.code}`);
  }
  return { ok, codes: codes.sort() };
}

const refused = (n: number) => Array.from({ length: n }, () => "429 quota_exceeded");
const times = <T>(n: number, f: (i: number) => T): T[] => Array.from({ length: n }, (_, i) => f(i));

function suite(name: string, open: () => Promise<Harness>) {
  describe(name, () => {
    let h: Harness;
    afterAll(() => h?.close());

    const create = (key: string) => () =>
      h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
    const act = (key: string, id: string, action: "suspend" | "resume") => () =>
      h.req("POST", `/v1/sandboxes/${id}/${action}`, { key });
    const created = async (key: string): Promise<string> => {
      const res = await create(key)();
      expect(res.status).toBe(201);
      return ((await res.json()) as Body).id as string;
    };
    /** The records of the tenant that owns sandbox `id`. */
    const rowsOf = async (id: string) => {
      const [t] = await h.handle.db
        .select({ tenantId: sandboxes.tenantId })
        .from(sandboxes)
        .where(eq(sandboxes.id, id));
      return h.handle.db.select().from(sandboxes).where(eq(sandboxes.tenantId, t!.tenantId));
    };
    /** Each phase in its own second: the per-key rate limit never enters. */
    const nextSecond = () => {
      h.now.ms += 1000;
    };

    test("setup", async () => {
      h = await open();
    }, 60_000);

    test("creates: 8 racing for 2 running places", async () => {
      const key = await h.key("creates", "pro");
      expect(await race(times(8, () => create(key)))).toEqual({
        ok: RUNNING.pro,
        codes: refused(8 - RUNNING.pro),
      });
    });

    test("sessions: 7 racing for 3 places", async () => {
      const key = await h.key("sessions", "live");
      const open = () => h.req("POST", "/v1/sessions", { key, json: { template_id: "python" } });
      expect(await race(times(7, () => open))).toEqual({ ok: SESSION_CAP, codes: refused(7 - SESSION_CAP) });
    });

    test("suspends: 8 racing for 3 suspended places; no hold is left behind", async () => {
      nextSecond();
      const key = await h.key("suspends", "enterprise");
      const ids: string[] = [];
      for (let i = 0; i < 8; i++) ids.push(await created(key));
      nextSecond();
      const r = await race(ids.map((id) => act(key, id, "suspend")));
      expect(r).toEqual({ ok: SUSPENDED.enterprise, codes: refused(8 - SUSPENDED.enterprise) });
      const rows = await rowsOf(ids[0]!);
      expect(rows.filter((x) => x.state === "suspended").length).toBe(SUSPENDED.enterprise);
      expect(rows.filter((x) => x.hold !== null)).toEqual([]);
      // The same sandbox twice at once, with places free: one suspend, the other a 409 (it is on
      // its way already; with the places full the hold itself makes it a 429).
      nextSecond();
      for (const x of rows.filter((x) => x.state === "suspended")) {
        expect((await h.req("DELETE", `/v1/sandboxes/${x.id}`, { key })).status).toBe(200);
      }
      const running = rows.find((x) => x.state === "running")!.id;
      const twice = await race(times(2, () => act(key, running, "suspend")));
      expect(twice).toEqual({ ok: 1, codes: ["409 conflict"] });
    });

    test("resumes and creates: 6 resumes and 3 creates racing for 2 running places", async () => {
      nextSecond();
      const key = await h.key("resumes", "pro");
      const ids: string[] = [];
      // Six suspended, two at a time (the running cap).
      for (let i = 0; i < 6; i++) {
        ids.push(await created(key));
        if (i % 2 === 1)
          for (const id of ids.slice(-2)) expect((await act(key, id, "suspend")()).status).toBe(200);
      }
      nextSecond();
      const r = await race([...ids.map((id) => act(key, id, "resume")), ...times(3, () => create(key))]);
      expect(r).toEqual({ ok: RUNNING.pro, codes: refused(9 - RUNNING.pro) });
      const rows = await rowsOf(ids[0]!);
      expect(rows.filter((x) => x.state === "starting" || x.state === "running").length).toBe(RUNNING.pro);
      expect(rows.filter((x) => x.hold !== null)).toEqual([]);
    });

    test("templates: 6 bakes and 6 uploads racing for 2 places each; identical bakes are one", async () => {
      nextSecond();
      const pro = await h.key("bakes", "pro");
      const bake = (k: string, name: string) => () =>
        h.req("POST", "/v1/templates", { key: k, json: { name, image: "127.0.0.1:5000/team/app:1" } });
      expect(await race(times(6, (i) => bake(pro, `b${i}`)))).toEqual({
        ok: TEMPLATE_CAP,
        codes: refused(6 - TEMPLATE_CAP),
      });
      // A retry is never refused by the quota, even when it races the bake it retries.
      const other = await h.key("bakes-same", "pro");
      expect(await race(times(4, () => bake(other, "same")))).toEqual({ ok: 4, codes: [] });

      const scale = await h.key("uploads", "scale");
      const up = (id: string) => () =>
        h.req("POST", `/v1/templates?id=${id}`, {
          key: scale,
          body: "0123456789AB",
          headers: { "content-type": "application/octet-stream" },
        });
      expect(await race(times(6, (i) => up(`u${i}`)))).toEqual({
        ok: TEMPLATE_CAP,
        codes: refused(6 - TEMPLATE_CAP),
      });
      const rows = await h.handle.db.select().from(templates).where(isNotNull(templates.tenantId));
      const byTenant = new Map<string, number>();
      for (const r of rows) byTenant.set(r.tenantId!, (byTenant.get(r.tenantId!) ?? 0) + 1);
      expect([...byTenant.values()].sort()).toEqual([1, TEMPLATE_CAP, TEMPLATE_CAP]);
    });
  });
}

suite("PGlite", () => slowHarness());

onPostgres((name, url) => suite(name, async () => slowHarness(await url())));
