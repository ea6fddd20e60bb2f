/**
 * Size classes through the gateway app (docs/templates.md "Size classes", gateway/core/sizes.ts):
 * a bake declares them and its template lists them; a create names one (the agent is asked for
 * that class, and the record, the sandbox read, admission and metering carry its size), a size
 * the template lacks is 400 `size_unavailable` listing the classes it has, a catalog template
 * without classes refuses any size, forks keep the parent's size, and a create from a kept
 * snapshot allows only the snapshot's own size. Real PGlite; the agent is the in-memory stand-in:
 * every rule here runs in the gateway. With real VMs (each class's size seen from inside the
 * guest): tests/vm/template-sizes.test.ts and tests/e2e/template-sizes.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { and, eq } from "drizzle-orm";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";

type Json = Record<string, unknown>;
const json = async (res: Response) => (await res.json()) as Json;

let h: Harness;
let pro: string;
let demo: string;
const SIZES = [
  { vcpus: 1, memory_mib: 128 },
  { vcpus: 2, memory_mib: 192 },
];

async function create(body: Json, key = pro): Promise<Response> {
  return h.req("POST", "/v1/sandboxes", { key, json: body });
}

describe("size classes through the gateway", () => {
  beforeAll(async () => {
    h = await makeHarness();
    pro = await h.key("acme", "pro");
    demo = await h.key("initech", "demo");
    const bake = await h.req("POST", "/v1/templates", {
      key: pro,
      json: { name: "sized", image: "127.0.0.1:5000/team/app:1", sizes: SIZES },
    });
    expect(bake.status).toBe(202);
    const [row] = await h.handle.db.select().from(templates).where(eq(templates.id, "sized"));
    h.agent.finishBuild(row!.agentRef, true);
  });
  afterAll(() => h.close());

  test("the template lists its classes, the default first; the agent is asked to build them all", async () => {
    const t = await json(await h.req("GET", "/v1/templates/sized", { key: pro }));
    expect(t.phase).toBe("Live");
    expect(t.sizes).toEqual(SIZES);
    const [row] = await h.handle.db.select().from(templates).where(eq(templates.id, "sized"));
    expect({ vcpus: row!.vcpuCount, mem: row!.memMib }).toEqual({ vcpus: 1, mem: 128 });
    const source = h.agent.templates.get(row!.agentRef)!.source!;
    expect(source.kind === "oci" ? source.sizes : undefined).toEqual([
      { vcpus: 1, memMib: 128 },
      { vcpus: 2, memMib: 192 },
    ]);
  });

  test("a bake listing a class twice, or more than 4, is 400", async () => {
    const twice = await h.req("POST", "/v1/templates", {
      key: pro,
      json: { name: "twice", image: "127.0.0.1:5000/team/app:1", sizes: [SIZES[0], SIZES[0]] },
    });
    expect(twice.status).toBe(400);
    expect((await json(twice)).code).toBe("bad_request");
    const five = Array.from({ length: 5 }, (_, i) => ({ vcpus: 1, memory_mib: 128 + 64 * i }));
    const many = await h.req("POST", "/v1/templates", {
      key: pro,
      json: { name: "many", image: "127.0.0.1:5000/team/app:1", sizes: five },
    });
    expect(many.status).toBe(400);
  });

  test("a declared class starts at its size: record, read, metering, forks", async () => {
    const big = await create({ template: "sized", vcpus: 2, memory_mib: 192 });
    expect(big.status).toBe(201);
    const id = (await json(big)).id as string;
    expect(h.agent.calls.at(-1)).toMatch(/^create .*\.sized sandbox$/);
    const info = await json(await h.req("GET", `/v1/sandboxes/${id}`, { key: pro }));
    expect({ vcpus: info.vcpus, memory_mib: info.memory_mib }).toEqual({ vcpus: 2, memory_mib: 192 });
    // Metering weighs by the size it runs at: its running interval holds it.
    const [iv] = await h.handle.db.select().from(usageIntervals).where(eq(usageIntervals.sandboxId, id));
    expect({ vcpus: iv!.vcpus, memMib: iv!.memMib }).toEqual({ vcpus: 2, memMib: 192 });
    // One field that names one class is enough.
    const byMem = await json(await create({ template: "sized", memory_mib: 192 }));
    expect((await json(await h.req("GET", `/v1/sandboxes/${byMem.id}`, { key: pro }))).vcpus).toBe(2);
    // The default class without a size.
    const plain = await json(await create({ template: "sized" }));
    const [plainRow] = await h.handle.db
      .select()
      .from(sandboxes)
      .where(eq(sandboxes.id, plain.id as string));
    expect(plainRow!.vcpus).toBe(2); // the stand-in's default VM size: no class was asked of it
    const fork = await json(await h.req("POST", `/v1/sandboxes/${id}/fork`, { key: pro, json: {} }));
    const child = (fork.children as Json[])[0]!.id as string;
    const childInfo = await json(await h.req("GET", `/v1/sandboxes/${child}`, { key: pro }));
    expect({ vcpus: childInfo.vcpus, memory_mib: childInfo.memory_mib }).toEqual({
      vcpus: 2,
      memory_mib: 192,
    });
  });

  test("a size the template lacks is 400 size_unavailable listing its classes; nothing is reserved", async () => {
    const before = await h.handle.db.select().from(sandboxes);
    const calls = h.agent.calls.length;
    for (const body of [
      { template: "sized", vcpus: 2, memory_mib: 128 },
      { template: "sized", vcpus: 4 },
      { template: "sized", memory_mib: 256 },
    ]) {
      const res = await create(body);
      expect(res.status).toBe(400);
      const e = await json(res);
      expect(e.code).toBe("size_unavailable");
      expect(e.message as string).toContain("template sized has no size class of");
      expect((e.details as Json).sizes).toEqual(SIZES);
    }
    expect(h.agent.calls.length).toBe(calls);
    expect((await h.handle.db.select().from(sandboxes)).length).toBe(before.length);
  });

  test("a catalog template without classes refuses any size, on any tier", async () => {
    for (const key of [pro, demo]) {
      const res = await create({ template: "python", vcpus: 1, memory_mib: 256 }, key);
      expect(res.status).toBe(400);
      const e = await json(res);
      expect(e.code).toBe("size_unavailable");
      expect((e.details as Json).sizes).toEqual([]);
    }
    expect((await create({ template: "python" }, demo)).status).toBe(201);
  });

  test("a size out of every bound is 400 bad_request before any lookup", async () => {
    const res = await create({ template: "sized", vcpus: 0 });
    expect(res.status).toBe(400);
    expect((await json(res)).code).toBe("bad_request");
  });

  test("from a kept snapshot only its own size: anything else says a snapshot's size is fixed", async () => {
    const src = (await json(await create({ template: "sized", vcpus: 2, memory_mib: 192 }))).id as string;
    const snap = await json(await h.req("POST", `/v1/sandboxes/${src}/snapshots`, { key: pro, json: {} }));
    const res = await create({ snapshot: snap.id, vcpus: 1, memory_mib: 128 });
    expect(res.status).toBe(400);
    const e = await json(res);
    expect(e.code).toBe("size_unavailable");
    expect(e.message as string).toContain("a snapshot's size is fixed");
    expect((e.details as Json).sizes).toEqual([{ vcpus: 2, memory_mib: 192 }]);
    const same = await create({ snapshot: snap.id, vcpus: 2, memory_mib: 192 });
    expect(same.status).toBe(201);
    const none = await create({ snapshot: snap.id });
    expect(none.status).toBe(201);
    const [row] = await h.handle.db
      .select()
      .from(sandboxes)
      .where(and(eq(sandboxes.id, (await json(none)).id as string)));
    expect(row!.vcpus).toBe(2);
  });
});
