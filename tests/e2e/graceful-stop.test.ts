/**
 * The graceful stop of a running service (contracts/drain.ts, docs/operations.md "Probes and
 * graceful stop"), end to end: `bin/sandboxd up` with a 1 s drain delay, a real VM of the python
 * template, the real HTTP API. `/livez` and `/readyz` answer without credentials. SIGTERM arrives
 * while a 5 s exec runs: `/readyz` turns 503 `draining` (while `/livez` still answers) before the
 * exec returns, the exec returns its whole result, and the process exits 0 afterwards. Its logs
 * are JSON (SANDBOXD_LOG_FORMAT): the exec's access line names its request id, tenant and sandbox.
 */
import { expect, test } from "bun:test";
import { existsSync } from "node:fs";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { expectOk } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** The exec under the stop: long enough for the readiness probe to be seen turning. */
const EXEC_S = 5;
/** One VM's boot from the template, the exec and the stop, on a loaded host. */
const TEST_TIMEOUT_MS = 180_000;

const fx = useService({
  keys: { key: ["acme", "pro"] },
  env: { SANDBOXD_DRAIN_DELAY: "1", SANDBOXD_LOG_FORMAT: "json" },
});

async function probe(path: string): Promise<{ status: number; body: string }> {
  const res = await fetch(`${fx.svc.url}${path}`);
  return { status: res.status, body: await res.text() };
}

test(
  "SIGTERM during a 5 s exec: /readyz goes 503 first, the exec returns its result, the process exits 0",
  async () => {
    expect(await probe("/livez")).toEqual({ status: 200, body: '{"status":"ok"}' });
    expect(await probe("/readyz")).toEqual({ status: 200, body: '{"status":"ready"}' });
    const key = fx.keys.key;
    const created = await fx.api.post("/v1/sandboxes", { key, json: { template: "python" } });
    const id = expectOk(created, 201, B.CreateSandboxResponse).id;
    const pid = fx.svc.pid;

    const t0 = performance.now();
    let execDoneMs = 0;
    const exec = fx.api
      .post(`/v1/sandboxes/${id}/exec`, {
        key,
        json: { command: `sleep ${EXEC_S}; echo finished`, timeout_seconds: 60 },
      })
      .then((r) => {
        execDoneMs = performance.now() - t0;
        return r;
      });
    await Bun.sleep(1_000);
    process.kill(pid, "SIGTERM");
    const signalMs = performance.now() - t0;
    let unreadyMs = 0;
    let liveWhileDraining = 0;
    while (execDoneMs === 0 && unreadyMs === 0) {
      const r = await probe("/readyz").catch(() => ({ status: 0, body: "" }));
      if (r.status === 503) {
        expect(r.body).toBe('{"status":"draining"}');
        unreadyMs = performance.now() - t0;
        liveWhileDraining = (await probe("/livez")).status;
      }
      await Bun.sleep(50);
    }
    const res = await exec;
    const r = expectOk(res, 200, B.ExecResponseB);
    expect({ exit: r.exit_code, out: r.stdout.trim() }).toEqual({ exit: 0, out: "finished" });
    expect(unreadyMs).toBeGreaterThan(0);
    expect(unreadyMs).toBeLessThan(execDoneMs);
    expect(liveWhileDraining).toBe(200);
    // JSON logs: the exec's access line, with its request id, tenant and sandbox.
    const lines = fx.svc
      .logTail(2000)
      .split("\n")
      .flatMap((l) => {
        try {
          return [JSON.parse(l) as Record<string, unknown>];
        } catch {
          return [];
        }
      });
    const accessLine = lines.find((l) => l.kind === "access" && l.path === `/v1/sandboxes/${id}/exec`);
    // Printed first: Bun's toMatchObject writes its matchers into the object it matched.
    console.log(`JSON_LOG_LINE ${JSON.stringify(accessLine)}`);
    expect(accessLine).toMatchObject({
      level: "info",
      status: 200,
      sandbox: id,
      request_id: res.headers.get("x-request-id"),
      tenant: expect.stringMatching(/^ten_/),
    });
    // The process ends by itself once the exec is answered (no second signal).
    const deadline = performance.now() + 60_000;
    while (existsSync(`/proc/${pid}`) && performance.now() < deadline) await Bun.sleep(100);
    const stopped = await fx.stop();
    expect(stopped.exit).toBe(0);
    console.log(
      `GRACEFUL_STOP ${JSON.stringify({ signal_ms: Math.round(signalMs), unready_ms: Math.round(unreadyMs), exec_answered_ms: Math.round(execDoneMs), exec_s: EXEC_S })}`,
    );
  },
  TEST_TIMEOUT_MS,
);
