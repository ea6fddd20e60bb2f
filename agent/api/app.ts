/**
 * The agent's own HTTP API (docs/agent-api.md), called only by the gateway through
 * `AgentHttpClient` (gateway/agents/client.ts). Handlers only parse: every request becomes a typed
 * `AgentAction` (zod at the edge) that `perform` (actions.ts) runs on the manager; errors become
 * `{code, message}` in one place (errors.ts). Every route needs the gateway's short-lived JWT,
 * signed with this agent's own key and made out to this agent's id (contracts/agent/token.ts).
 */
import { type Context, Hono } from "hono";
import { bodyLimit } from "hono/body-limit";
import type { z } from "zod";
import { AGENT_API_PREFIX, type CreateVmOpts, PTY_PID_HEADER } from "../../contracts/agent/api.ts";
import { PtyQuery } from "../../contracts/agent/pty.ts";
import {
  CreateBody,
  DeleteQuery,
  EgressBody,
  ExecBody,
  ExecOnceBody,
  ForkBody,
  RestoreSnapshotBody,
  SnapshotRefParam,
  SnapshotVmBody,
  TakeSnapshotBody,
  TunnelQuery,
  VmIdParam,
} from "../../contracts/agent/schemas.ts";
import { type AgentCredentials, secretKey, verifyAgentToken } from "../../contracts/agent/token.ts";
import { AGENT_MAX_JSON_BODY_BYTES } from "../../contracts/api/limits.ts";
import { DEFAULT_DISK_RESERVE_BYTES } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { GuestTunnel } from "../guest/client.ts";
import type { SandboxManager } from "../sandbox/manager.ts";
import { type AgentAction, perform } from "./actions.ts";
import { mapAgentError } from "./errors.ts";
import { streamExec } from "./exec-stream.ts";
import { fileRoutes } from "./files.ts";
import { processRoutes } from "./processes.ts";
import { templateRoutes } from "./templates.ts";
import type { TunnelSocketData } from "./tunnel-ws.ts";

export interface AgentAppDeps {
  manager: SandboxManager;
  /** This agent's id and key from enrollment (agent/api/enroll.ts); tokens must be for this id. */
  credentials: AgentCredentials;
  /** Uploaded template images are staged here until their build ends. */
  uploadDir: string;
  /** Free disk an upload leaves (`SANDBOXD_DISK_RESERVE_BYTES`); default DEFAULT_DISK_RESERVE_BYTES. */
  diskReserveBytes?: number;
  version?: string;
  log?: (msg: string) => void;
}

/**
 * The largest exec request a gateway may accept (its files included) re-encoded for this API,
 * plus the gateway's own fields (contracts/api/limits.ts): refused before it is buffered. Image
 * uploads are streamed to disk instead.
 */
const MAX_JSON_BODY_BYTES = AGENT_MAX_JSON_BODY_BYTES;

export function createAgentApp(deps: AgentAppDeps): Hono {
  const key = secretKey(deps.credentials.key);
  const agentId = deps.credentials.id;
  const log = deps.log ?? (() => {});
  const actionDeps = { manager: deps.manager, version: deps.version ?? "sandboxd-agent-dev", log };
  const app = new Hono();

  app.onError((err, c) => {
    const { status, body, headers } = mapAgentError(err);
    if (status >= 500) log(`${c.req.method} ${c.req.path}: ${status} ${body.code}: ${body.message}`);
    return c.json(body, status, headers);
  });
  app.notFound((c) => c.json({ code: "not_found", message: `no route ${c.req.method} ${c.req.path}` }, 404));

  app.use("*", async (c, next) => {
    const v = await verifyAgentToken(key, agentId, c.req.header("authorization"));
    if (!v.ok) throw v.error;
    await next();
  });

  const json = bodyLimit({
    maxSize: MAX_JSON_BODY_BYTES,
    onError: () => {
      throw new SandboxdError("payload_too_large", `request body exceeds ${MAX_JSON_BODY_BYTES} bytes`);
    },
  });

  const run = async (action: AgentAction) => {
    const r = await perform(actionDeps, action);
    return r.status === 204
      ? new Response(null, { status: 204 })
      : Response.json(r.body, { status: r.status });
  };

  const r = new Hono();
  r.get("/health", () => run({ kind: "health" }));
  r.get("/vms", () => run({ kind: "list" }));
  r.post("/vms", json, async (c) => {
    const b = parse(CreateBody, await body(c.req.raw));
    const opts: CreateVmOpts = b.egressAllow
      ? { kind: b.kind, egressAllow: b.egressAllow }
      : { kind: b.kind };
    if (b.vcpus !== undefined) opts.vcpus = b.vcpus;
    if (b.memMib !== undefined) opts.memMib = b.memMib;
    return run({ kind: "create", template: b.template, opts });
  });
  r.post("/exec-once", json, async (c) => {
    const b = parse(ExecOnceBody, await body(c.req.raw));
    return run({ kind: "execOnce", template: b.template, action: b.action });
  });
  r.get("/vms/:id", (c) => run({ kind: "info", vmId: parse(VmIdParam, c.req.param("id")) }));
  r.get("/vms/:id/metrics", (c) => run({ kind: "metrics", vmId: parse(VmIdParam, c.req.param("id")) }));
  r.post("/vms/:id/exec", json, async (c) => {
    const vmId = parse(VmIdParam, c.req.param("id"));
    const action = parse(ExecBody, await body(c.req.raw));
    // Streamed (exec-stream.ts): a live body rather than one answer, so not through `perform`.
    if (c.req.query("stream") === "1") return streamExec(deps.manager, vmId, action, c.req.raw.signal);
    return run({ kind: "exec", vmId, action });
  });
  r.post("/vms/:id/fork", json, async (c) =>
    run({
      kind: "fork",
      vmId: parse(VmIdParam, c.req.param("id")),
      count: parse(ForkBody, await body(c.req.raw)).count,
    }),
  );
  r.post("/vms/:id/snapshots", json, async (c) =>
    run({
      kind: "takeSnapshot",
      vmId: parse(VmIdParam, c.req.param("id")),
      ref: parse(TakeSnapshotBody, await body(c.req.raw)).snapshot,
    }),
  );
  r.post("/vms/:id/restore", json, async (c) =>
    run({
      kind: "restoreSnapshot",
      vmId: parse(VmIdParam, c.req.param("id")),
      ref: parse(RestoreSnapshotBody, await body(c.req.raw)).snapshot,
    }),
  );
  r.post("/snapshots/:ref/vms", json, async (c) => {
    const b = parse(SnapshotVmBody, await body(c.req.raw));
    const opts: CreateVmOpts = { kind: b.kind };
    if (b.egressAllow !== undefined) opts.egressAllow = b.egressAllow;
    return run({ kind: "createFromSnapshot", ref: parse(SnapshotRefParam, c.req.param("ref")), opts });
  });
  r.get("/snapshots", () => run({ kind: "listSnapshots" }));
  r.delete("/snapshots/:ref", (c) =>
    run({ kind: "deleteSnapshot", ref: parse(SnapshotRefParam, c.req.param("ref")) }),
  );
  // A byte tunnel to a guest port, upgraded to a WebSocket (docs/agent-api.md "Tunnels"). The
  // guest connect happens before the upgrade, so a refused port or a stopped VM is an ordinary
  // JSON error; once upgraded, agent/api/tunnel-ws.ts carries the bytes. The result is a live
  // stream rather than a body, so the manager is called here instead of through `perform`.
  r.get("/vms/:id/tunnel", (c) => {
    const { port } = parse(TunnelQuery, c.req.query());
    return upgradeTunnel(c, (vmId) => deps.manager.openTunnel(vmId, port));
  });
  // A shell on a pseudo-terminal (docs/agent-api.md "Tunnels"): a tunnel to its master, plus
  // text messages `{"type":"resize","cols":N,"rows":M}` that set the window size.
  r.get("/vms/:id/pty", (c) => {
    const opts = parse(PtyQuery, c.req.query());
    return upgradeTunnel(c, (vmId) => deps.manager.openPty(vmId, opts), true);
  });
  processRoutes(r, deps.manager, { json, parse, body });
  fileRoutes(r, deps.manager, parse);
  r.post("/vms/:id/suspend", (c) => run({ kind: "suspend", vmId: parse(VmIdParam, c.req.param("id")) }));
  r.post("/vms/:id/resume", (c) => run({ kind: "resume", vmId: parse(VmIdParam, c.req.param("id")) }));
  r.put("/vms/:id/egress", json, async (c) =>
    run({
      kind: "setEgress",
      vmId: parse(VmIdParam, c.req.param("id")),
      egressAllow: parse(EgressBody, await body(c.req.raw)).egressAllow,
    }),
  );
  r.delete("/vms/:id", (c) =>
    run({
      kind: "destroy",
      vmId: parse(VmIdParam, c.req.param("id")),
      force: parse(DeleteQuery, c.req.query()).force,
    }),
  );

  templateRoutes(r, deps.uploadDir, deps.diskReserveBytes ?? DEFAULT_DISK_RESERVE_BYTES, {
    json,
    parse,
    body,
    run,
    exportTemplate: (t) => deps.manager.exportTemplate(t),
    assertBuildable: (t) => deps.manager.templates.assertBuildable(t),
  });
  app.route(AGENT_API_PREFIX, r);
  return app;
}

async function body(req: Request): Promise<unknown> {
  try {
    return await req.json();
  } catch (err) {
    throw new SandboxdError("bad_request", "the body is not JSON", { cause: err });
  }
}

function parse<T extends z.ZodType>(schema: T, value: unknown): z.infer<T> {
  const r = schema.safeParse(value);
  if (!r.success) {
    const issues = r.error.issues.map((i) => `${i.path.join(".") || "(root)"}: ${i.message}`).join("; ");
    throw new SandboxdError("bad_request", issues, { cause: r.error });
  }
  return r.data;
}

/**
 * Opens the guest side with `open` before the upgrade (so its failures are JSON errors), then
 * upgrades; agent/api/tunnel-ws.ts carries the bytes. `pty`: text messages are resize requests.
 */
async function upgradeTunnel(c: Context, open: (vmId: string) => Promise<GuestTunnel>, pty = false) {
  const vmId = parse(VmIdParam, c.req.param("id"));
  if (c.req.header("upgrade")?.toLowerCase() !== "websocket") {
    throw new SandboxdError("bad_request", "the tunnel route needs a WebSocket upgrade");
  }
  // Under Bun.serve, Hono's env is the server (agent/server.ts); app.request() has none.
  const server = c.env as
    | { upgrade?: (req: Request, o: { data: TunnelSocketData; headers?: Record<string, string> }) => boolean }
    | undefined;
  if (typeof server?.upgrade !== "function") {
    throw new SandboxdError("unsupported", "this agent server cannot upgrade to WebSocket");
  }
  const tunnel = await open(vmId);
  const data: TunnelSocketData = { kind: "tunnel", tunnel };
  if (pty) data.resize = (cols, rows) => tunnel.resize(cols, rows);
  // A terminal's shell pid in the guest rides on the 101 answer (docs/agent-api.md "Tunnels").
  const headers: Record<string, string> = {};
  if (pty && tunnel.pid !== undefined) headers[PTY_PID_HEADER] = String(tunnel.pid);
  if (!server.upgrade(c.req.raw, { data, headers })) {
    tunnel.close();
    throw new SandboxdError("bad_request", "the WebSocket upgrade failed");
  }
  return new Response(null); // ignored by Bun once upgraded
}
