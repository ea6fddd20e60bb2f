import { expect, test } from "bun:test";
import { Drain } from "./drain.ts";

const get = (path: string) => new Request(`http://x${path}`);

test("probes: livez always, readyz from the check until draining; other paths are not probes", async () => {
  const d = new Drain();
  expect(d.probe(get("/v1/health"))).toBeUndefined();
  expect(d.probe(new Request("http://x/readyz", { method: "POST" }))).toBeUndefined();
  expect((await d.probe(get("/livez")))?.status).toBe(200);
  expect((await d.probe(get("/readyz")))?.status).toBe(200);
  expect((await d.probe(get("/readyz"), async () => false))?.status).toBe(503);
  expect((await d.probe(get("/readyz"), () => Promise.reject(new Error("db down"))))?.status).toBe(503);
  const draining = d.drain({ delayMs: 0, timeoutMs: 10 });
  const r = await d.probe(get("/readyz"));
  expect([r?.status, await r?.text()]).toEqual([503, '{"status":"draining"}']);
  expect((await d.probe(get("/livez")))?.status).toBe(200);
  expect(await draining).toBe(0);
});

test("a drain waits for the requests in flight, and gives up at its timeout", async () => {
  const d = new Drain();
  let finish!: () => void;
  d.track(new Promise<void>((r) => (finish = r)));
  d.track(Promise.reject(new Error("a failed request ends too")).catch(() => {}));
  expect(d.active).toBeGreaterThanOrEqual(1);
  const t0 = performance.now();
  const drained = d.drain({ delayMs: 20, timeoutMs: 5_000 });
  setTimeout(finish, 100);
  expect(await drained).toBe(0);
  expect(performance.now() - t0).toBeGreaterThanOrEqual(95);
  expect(d.active).toBe(0);

  const stuck = new Drain();
  stuck.track(new Promise(() => {}));
  expect(await stuck.drain({ delayMs: 0, timeoutMs: 50 })).toBe(1);
});
