/**
 * Background processes (docs/api.md "Background processes"), the same routes for sandboxes API
 * sandboxes (`/v1/sandboxes/{id}/processes`) and sessions API sessions (`/v1/sessions/{id}/processes`):
 * start, list, logs (JSON, or followed as Server-Sent Events in the streamed exec's format), stdin
 * (JSON `{data}` / `{data_b64}`, or the raw body), kill. The rules are core/processes.ts.
 */
import { type Context, Hono } from "hono";
import type { ProcessInfo as AgentProcessInfo, ProcessStart } from "../../contracts/agent/processes.ts";
import { MAX_EXEC_STDIN_BYTES } from "../../contracts/api/limits.ts";
import { type ProcessInfo, ProcessStdinRequest, StartProcessRequest } from "../../contracts/api/processes.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { requireApi } from "../auth/guards.ts";
import { processCall } from "../core/processes.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { jsonBody, readBodyLimited } from "../http.ts";
import { sseExec, wantsEventStream } from "./exec-sse.ts";

const publicInfo = (i: AgentProcessInfo): ProcessInfo => ({
  pid: i.pid,
  command: i.command,
  running: i.running,
  exit_code: i.exitCode,
  keep_awake: i.keepAwake,
});

/** A pid in the path: a positive integer, else 404 like an unknown one. */
function pidOf(c: Context): number {
  const raw = c.req.param("pid") ?? "";
  const n = /^[1-9][0-9]{0,9}$/.test(raw) ? Number(raw) : 0;
  if (n < 1 || n > 2 ** 31) throw new SandboxdError("not_found", `no background process ${raw}`);
  return n;
}

export function processRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const max = () => deps.config.limits.maxJsonBodyBytes;

  for (const [base, api] of [
    ["/v1/sandboxes", "sandboxes"],
    ["/v1/sessions", "sessions"],
  ] as const) {
    const call = <T>(c: Context<HonoEnv>, fn: Parameters<typeof processCall<T>>[3]) => {
      const p = c.get("principal");
      requireApi(p, api);
      return processCall(deps, p, c.req.param("id") ?? "", fn);
    };

    app.post(`${base}/:id/processes`, async (c) => {
      requireApi(c.get("principal"), api);
      const req = await jsonBody(c, StartProcessRequest, max());
      const start: ProcessStart = {
        run:
          req.command !== undefined
            ? { kind: "shell", command: req.command }
            : { kind: "argv", commands: [req.argv ?? []] },
        keepAwake: req.keep_awake ?? false,
      };
      if (req.env !== undefined) start.env = req.env;
      if (req.cwd !== undefined) start.cwd = req.cwd;
      if (req.user !== undefined) start.user = req.user;
      const info = await call(c, (a, vm) => a.startProcess(vm, start));
      return c.json(publicInfo(info), 201);
    });

    app.get(`${base}/:id/processes`, async (c) => {
      const list = await call(c, (a, vm) => a.listProcesses(vm));
      return c.json({ processes: list.map(publicInfo) });
    });

    app.get(`${base}/:id/processes/:pid/logs`, async (c) => {
      const pid = pidOf(c);
      if (wantsEventStream(c.req.header("accept"))) {
        return sseExec(
          c.req.raw.signal,
          (o) => call(c, (a, vm) => a.followProcess(vm, pid, o)),
          (i) => publicInfo(i),
        );
      }
      const logs = await call(c, (a, vm) => a.processLogs(vm, pid));
      return c.json({
        stdout: Buffer.from(logs.stdoutB64, "base64").toString("utf8"),
        stderr: Buffer.from(logs.stderrB64, "base64").toString("utf8"),
        truncated: logs.truncated,
        process: publicInfo(logs.process),
      });
    });

    app.post(`${base}/:id/processes/:pid/stdin`, async (c) => {
      requireApi(c.get("principal"), api);
      const pid = pidOf(c);
      let bytes: Buffer;
      let eof = false;
      if ((c.req.header("content-type") ?? "").split(";")[0]?.trim() === "application/json") {
        const req = await jsonBody(c, ProcessStdinRequest, max());
        bytes =
          req.data_b64 !== undefined
            ? Buffer.from(req.data_b64, "base64")
            : Buffer.from(req.data ?? "", "utf8");
        eof = req.eof ?? false;
      } else {
        // Raw bytes as they are; `?eof=true` closes stdin after them.
        bytes = Buffer.from(await readBodyLimited(c, MAX_EXEC_STDIN_BYTES));
        eof = c.req.query("eof") === "true";
      }
      await call(c, (a, vm) => a.processStdin(vm, pid, { dataB64: bytes.toString("base64"), eof }));
      return c.json({ pid, bytes: bytes.length });
    });

    app.delete(`${base}/:id/processes/:pid`, async (c) => {
      const pid = pidOf(c);
      return c.json(publicInfo(await call(c, (a, vm) => a.killProcess(vm, pid))));
    });
  }
  return app;
}
