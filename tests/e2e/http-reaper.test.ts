/**
 * The idle reaper in a running service, end to end: `bin/sandboxd up` with a 4 s session TTL and
 * a 1 s reaper interval set by environment (SANDBOXD_SESSION_IDLE_TTL, SANDBOXD_REAPER_INTERVAL),
 * real VMs of the catalog's python template, the real HTTP API. A session left idle past the TTL
 * is reclaimed by the service itself (no test calls the reaper) and answers 410 `gone`; its QEMU
 * goes. A session whose exec runs 6 s, longer than the TTL, is not reclaimed during the exec and
 * answers afterwards; idle after it, it is reclaimed too (so the reaper did run meanwhile).
 *
 * Tests run in order and share one service; the last stops it and checks no QEMU is left.
 */
import { beforeAll, expect, test } from "bun:test";
import { HealthResponse } from "../../contracts/api/health.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { expectError, expectOk, qemusUnder, waitFor } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** The TTL under test: short, so a test waits seconds; set by environment like an operator would. */
const TTL_S = 4;
/** The reaper's interval: a reclaim is at most this late past the TTL. */
const INTERVAL_S = 1;
/**
 * How long a test waits for a reclaim that is due at TTL + interval: a harness wait (a loaded CI
 * host may run a pass late), not a claim about speed.
 */
const RECLAIM_WAIT_MS = 30_000;
/** Each test boots one or two VMs and waits for a reclaim. */
const TEST_TIMEOUT_MS = 120_000;

const fx = useService({
  keys: { key: ["acme", "live"] },
  env: { SANDBOXD_SESSION_IDLE_TTL: String(TTL_S), SANDBOXD_REAPER_INTERVAL: String(INTERVAL_S) },
});
let key = "";
beforeAll(() => {
  ({ key } = fx.keys);
});
/** Sessions not reclaimed yet: deleted after the test that made them (pass or fail). */
const liveSessions = new Set<string>();
const api = () => fx.api;

async function createSession(): Promise<string> {
  const res = await api().post("/v1/sessions", { key, json: { template_id: "python" } });
  const id = expectOk(res, 201, A.CreateSessionResponse).session_id;
  liveSessions.add(id);
  fx.cleanup(async () => {
    if (liveSessions.delete(id)) await fx.api.delete(`/v1/sessions/${id}`, { key, query: { force: "true" } });
  });
  return id;
}

async function exec(id: string, code: string): Promise<string> {
  const res = await api().post(`/v1/sessions/${id}/exec`, { key, json: { code, timeout_seconds: 60 } });
  const r = expectOk(res, 200, A.ExecResultA);
  expect(r.exit_code).toBe(0);
  return r.stdout;
}

/** Waits until the session answers 410 (reclaimed); returns the seconds it took from `since`. */
async function waitReclaimed(id: string, since: number): Promise<number> {
  let last = 0;
  const gone = await waitFor(async () => {
    last = (await api().get(`/v1/sessions/${id}`, { key })).status;
    return last === 410;
  }, RECLAIM_WAIT_MS);
  if (!gone) throw new Error(`session ${id} not reclaimed (last GET ${last}):\n${fx.svc.logTail()}`);
  return (performance.now() - since) / 1000;
}

test("health shows the settings in force, the environment's among them", async () => {
  const h = expectOk(await api().get("/v1/health"), 200, HealthResponse);
  expect(h.settings?.SANDBOXD_SESSION_IDLE_TTL).toBe(TTL_S);
  expect(h.settings?.SANDBOXD_REAPER_INTERVAL).toBe(INTERVAL_S);
  expect(h.settings?.SANDBOXD_SESSION_CAP).toBe(100); // a default
});

test(
  "a session idle past the 4 s TTL is reclaimed by the running service and answers 410",
  async () => {
    const id = await createSession();
    expect(await exec(id, "print(6 * 7)")).toBe("42\n");
    const idleFrom = performance.now();
    // Half the TTL later it is still there: reading its status is not activity, and not idle enough.
    await Bun.sleep((TTL_S / 2) * 1000);
    const st = expectOk(await api().get(`/v1/sessions/${id}`, { key }), 200, A.SessionStatus);
    expect(st.exec_count).toBe(1);
    expect(st.idle_secs).toBeGreaterThanOrEqual(TTL_S / 2 - 0.5);

    const after = await waitReclaimed(id, idleFrom);
    console.log(JSON.stringify({ reclaimed_after_idle_s: Math.round(after * 10) / 10, ttl_s: TTL_S }));
    // Counted from when the client saw the exec's answer, a few ms after the gateway stamped its
    // end: never reclaimed before the TTL, less that transfer.
    expect(after).toBeGreaterThanOrEqual(TTL_S - 0.25);
    liveSessions.delete(id);
    expectError(await api().get(`/v1/sessions/${id}`, { key }), 410, "gone");
    expectError(
      await api().post(`/v1/sessions/${id}/exec`, { key, json: { code: "print(1)" } }),
      410,
      "gone",
    );
    expectError(await api().delete(`/v1/sessions/${id}`, { key }), 410, "gone");
    const list = expectOk(await api().get("/v1/sessions", { key }), 200, A.SessionList);
    expect(list.sessions.map((s) => s.session_id)).not.toContain(id);
    // Its VM went with it.
    expect(await waitFor(async () => (await qemusUnder(fx.dataDir)).length === 0, 10_000)).toBe(true);
  },
  TEST_TIMEOUT_MS,
);

test(
  "an exec running 6 s under the 4 s TTL is not reaped; the session answers after it",
  async () => {
    const id = await createSession();
    const t0 = performance.now();
    const running = exec(id, "import time\ntime.sleep(6)\nprint('slept')");
    // Past the TTL since the session was made, with the exec still running: not reclaimed.
    await Bun.sleep((TTL_S + 2 * INTERVAL_S) * 1000);
    const mid = expectOk(await api().get(`/v1/sessions/${id}`, { key }), 200, A.SessionStatus);
    expect(mid.idle_secs).toBe(0); // an exec in flight is activity
    expect(await running).toBe("slept\n");
    expect(performance.now() - t0).toBeGreaterThan(6_000);
    // The exec's end reset idleness: the session answers at once, with its state.
    expect(await exec(id, "print('after')")).toBe("after\n");
    const st = expectOk(await api().get(`/v1/sessions/${id}`, { key }), 200, A.SessionStatus);
    expect(st.exec_count).toBe(2);
    // Left idle now, it goes like any other: the reaper ran all along.
    await waitReclaimed(id, performance.now());
    liveSessions.delete(id);
  },
  TEST_TIMEOUT_MS,
);

test("stopping the service leaves no QEMU", async () => {
  const { exit, qemus } = await fx.stop();
  expect(exit).toBe(0);
  expect(qemus).toEqual([]);
});
