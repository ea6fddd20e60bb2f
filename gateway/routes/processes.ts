/**
 * Background processes (docs/processes-and-pty.md "Background processes"), the same routes for sandboxes API
 * sandboxes (`/v1/sandboxes/{id}/processes`) and sessions API sessions (`/v1/sessions/{id}/processes`):
 * start, list, logs (JSON, or followed as Server-Sent Events in the streamed exec's format), stdin
 * (JSON `{data}` / `{data_b64}`, or the raw body), kill. The rules are core/processes.ts.
 */
import { type Context, Hono, type MiddlewareHandler } from "hono";
import type { ProcessInfo as AgentProcessInfo, ProcessStart } from "../../contracts/agent/processes.ts";
import { MAX_EXEC_STDIN_BYTES } from "../../contracts/api/limits.ts";
import { type ProcessInfo, ProcessStdinRequest, StartProcessRequest } from "../../contracts/api/processes.ts";
import type { KeyApi } from "../../contracts/api/tiers.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { requireApiMw } from "../auth/guards.ts";
import { processCall } from "../core/processes.ts";
import { type Deps, type HonoEnv, holdForKey } from "../deps.ts";
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

/** Where the logs and kill routes read the pid: a malformed one is a 404 before the key's API is checked. */
const pidFirst: MiddlewareHandler<HonoEnv> = async (c, next) => {
  pidOf(c);
  await next();
};

/** `POST .../processes`: the request as the agent's typed start. */
async function startOf(deps: Deps, c: Context<HonoEnv>): Promise<ProcessStart> {
  const req = await jsonBody(c, StartProcessRequest, deps.config.limits.maxJsonBodyBytes);
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
  return start;
}

/** `POST .../processes/{pid}/stdin`: JSON `{data}` / `{data_b64}`, or the raw body. */
async function stdinOf(deps: Deps, c: Context<HonoEnv>): Promise<{ bytes: Buffer; eof: boolean }> {
  if ((c.req.header("content-type") ?? "").split(";")[0]?.trim() === "application/json") {
    const req = await jsonBody(c, ProcessStdinRequest, deps.config.limits.maxJsonBodyBytes);
    const bytes =
      req.data_b64 !== undefined ? Buffer.from(req.data_b64, "base64") : Buffer.from(req.data ?? "", "utf8");
    return { bytes, eof: req.eof ?? false };
  }
  // Raw bytes as they are; `?eof=true` closes stdin after them.
  return {
    bytes: Buffer.from(await readBodyLimited(c, MAX_EXEC_STDIN_BYTES)),
    eof: c.req.query("eof") === "true",
  };
}

/** Mounted at `/v1/sandboxes` and at `/v1/sessions`, each with its own API. */
export function processRoutes(deps: Deps, api: KeyApi): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const only = requireApiMw(api);
  const call = <T>(c: Context<HonoEnv>, fn: Parameters<typeof processCall<T>>[3]) =>
    processCall(deps, c.get("principal"), c.req.param("id") ?? "", fn);

  app.post("/:id/processes", only, async (c) => {
    const start = await startOf(deps, c);
    const info = await call(c, (a, vm) => a.startProcess(vm, start));
    return c.json(publicInfo(info), 201);
  });

  app.get("/:id/processes", only, async (c) => {
    const list = await call(c, (a, vm) => a.listProcesses(vm));
    return c.json({ processes: list.map(publicInfo) });
  });

  app.get("/:id/processes/:pid/logs", pidFirst, only, async (c) => {
    const pid = pidOf(c);
    if (wantsEventStream(c.req.header("accept"))) {
      return sseExec(
        c.req.raw.signal,
        (o) => call(c, (a, vm) => a.followProcess(vm, pid, o)),
        (i) => publicInfo(i),
        (conn) => holdForKey(deps, c.get("principal").keyId, conn),
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

  app.post("/:id/processes/:pid/stdin", only, async (c) => {
    const pid = pidOf(c);
    const { bytes, eof } = await stdinOf(deps, c);
    await call(c, (a, vm) => a.processStdin(vm, pid, { dataB64: bytes.toString("base64"), eof }));
    return c.json({ pid, bytes: bytes.length });
  });

  app.delete("/:id/processes/:pid", pidFirst, only, async (c) => {
    const pid = pidOf(c);
    return c.json(publicInfo(await call(c, (a, vm) => a.killProcess(vm, pid))));
  });
  return app;
}
