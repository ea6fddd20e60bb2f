/**
 * The agent API's typed actions and the one function that carries them out on the manager
 * (after Firecracker's `VmmAction`): app.ts only parses HTTP into an `AgentAction`;
 * `perform` never sees HTTP and answers with a status and a body.
 */
import { rm } from "node:fs/promises";
import type { CreateVmOpts, TemplateSource } from "../../contracts/agent/api.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import type { TemplateInput } from "../sandbox/drivers/driver.ts";
import type { ExecRequest } from "../sandbox/exec.ts";
import type { SandboxManager } from "../sandbox/manager.ts";

export type AgentAction =
  | { kind: "health" }
  | { kind: "create"; template: string; opts: CreateVmOpts }
  | { kind: "execOnce"; template: string; action: ExecRequest }
  | { kind: "exec"; vmId: string; action: ExecRequest }
  | { kind: "fork"; vmId: string; count: number }
  | { kind: "takeSnapshot"; vmId: string; ref: string }
  | { kind: "createFromSnapshot"; ref: string; opts: CreateVmOpts }
  | { kind: "deleteSnapshot"; ref: string }
  | { kind: "restoreSnapshot"; vmId: string; ref: string }
  | { kind: "listSnapshots" }
  | { kind: "suspend"; vmId: string }
  | { kind: "resume"; vmId: string }
  | { kind: "destroy"; vmId: string; force: boolean }
  | { kind: "info"; vmId: string }
  | { kind: "metrics"; vmId: string }
  | { kind: "setEgress"; vmId: string; egressAllow: string[] }
  | { kind: "list" }
  | { kind: "buildTemplate"; template: string; source: TemplateSource }
  /** A copy of another agent's ready template, its bundle staged at `path` (the agent owns it). */
  | { kind: "copyTemplate"; template: string; path: string }
  | { kind: "templateStatus"; template: string }
  | { kind: "deleteTemplate"; template: string }
  | { kind: "expectWidth"; template: string; width: number }
  | { kind: "releaseTemplate"; template: string };

export interface ActionDeps {
  manager: SandboxManager;
  version: string;
  log: (msg: string) => void;
}

export type ActionResult = { status: 200 | 201 | 202; body: unknown } | { status: 204 };

export async function perform(deps: ActionDeps, a: AgentAction): Promise<ActionResult> {
  const m = deps.manager;
  switch (a.kind) {
    case "health":
      return {
        status: 200,
        body: {
          ok: true,
          version: deps.version,
          capacity: m.capacityNow(),
          driver: m.driverName,
          ...(m.accel ? { accel: m.accel } : {}),
        },
      };
    case "create":
      return { status: 201, body: await m.create(a.template, a.opts) };
    case "execOnce":
      return { status: 200, body: await m.execOnce(a.template, a.action) };
    case "exec":
      return { status: 200, body: await m.exec(a.vmId, a.action) };
    case "fork":
      return { status: 200, body: { children: await m.fork(a.vmId, a.count) } };
    case "takeSnapshot":
      return { status: 201, body: await m.takeSnapshot(a.vmId, a.ref) };
    case "createFromSnapshot":
      return { status: 201, body: await m.createFromSnapshot(a.ref, a.opts) };
    case "restoreSnapshot":
      return { status: 200, body: await m.restoreSnapshot(a.vmId, a.ref) };
    case "deleteSnapshot":
      await m.deleteSnapshot(a.ref);
      return { status: 204 };
    case "listSnapshots":
      return { status: 200, body: { snapshots: await m.listSnapshots() } };
    case "suspend":
      return { status: 200, body: await m.suspend(a.vmId) };
    case "resume":
      return { status: 200, body: await m.resume(a.vmId) };
    case "destroy":
      await m.destroy(a.vmId, { force: a.force });
      return { status: 204 };
    case "info":
      return { status: 200, body: { ...m.info(a.vmId), usage: m.usage(a.vmId) } };
    case "metrics":
      return { status: 200, body: m.metrics(a.vmId) };
    case "setEgress":
      return { status: 200, body: await m.setEgress(a.vmId, a.egressAllow) };
    case "list":
      return { status: 200, body: { vms: m.list() } };
    case "buildTemplate": {
      const s = a.source;
      if (s.kind === "upload") {
        const size = {
          ...(s.memMib !== undefined ? { memMib: s.memMib } : {}),
          ...(s.vcpuCount !== undefined ? { vcpus: s.vcpuCount } : {}),
        };
        try {
          // `wait_secs` bounds the build's bring-up (contracts/api/sessions-api.ts RegisterTemplateQuery).
          const input: TemplateInput = {
            kind: "archive",
            path: s.path,
            ...(s.waitSecs !== undefined ? { bringupTimeoutMs: s.waitSecs * 1000 } : {}),
          };
          m.buildTemplate(a.template, input, size);
        } catch (err) {
          await rm(s.path, { force: true });
          throw err;
        }
        // The agent owns the uploaded file (TemplateSource): gone once the build is over.
        // A leftover upload is swept with the upload dir: a failed removal is logged, never a crash.
        void m.templates
          .settled(a.template)
          .finally(() => bestEffort(deps.log, `removing the upload ${s.path}`, rm(s.path, { force: true })));
      } else {
        // Size classes (docs/templates.md "Size classes"): the first is the default one.
        const [first, ...rest] = s.sizes ?? [];
        m.buildTemplate(a.template, ociInput(s), first, rest);
        // Bake `expected_width` (docs/sandboxes.md "Rules of the sandboxes API"): warm VMs once the build is Live.
        if (s.expectedWidth !== undefined) m.expectWidth(a.template, s.expectedWidth);
      }
      return { status: 202, body: m.templates.status(a.template) };
    }
    case "copyTemplate":
      try {
        m.buildTemplate(a.template, { kind: "copy", path: a.path });
      } catch (err) {
        await rm(a.path, { force: true });
        throw err;
      }
      // The staged bundle goes once the copy is over, whatever the driver did with it.
      void m.templates
        .settled(a.template)
        .finally(() => bestEffort(deps.log, `removing the bundle ${a.path}`, rm(a.path, { force: true })));
      return { status: 202, body: m.templates.status(a.template) };
    case "templateStatus":
      return { status: 200, body: m.templates.status(a.template) };
    case "deleteTemplate":
      await m.deleteTemplate(a.template);
      return { status: 204 };
    case "expectWidth":
      m.expectWidth(a.template, a.width);
      return { status: 204 };
    case "releaseTemplate":
      await m.releaseTemplate(a.template);
      return { status: 204 };
  }
}

/**
 * A bake's source as the driver takes it (docs/templates.md "Rules of templates"): `ready.cmd` runs under `/bin/sh -c` with
 * `ready.env` added to the image's Env, bounded by `ready.http_timeout_s` (the command blocks
 * until the service answers its health check, so that is how long the bake waits for health);
 * `ready.ports` become the template's exposed ports.
 */
function ociInput(s: Extract<TemplateSource, { kind: "oci" }>): TemplateInput {
  const input: Extract<TemplateInput, { kind: "oci" }> = { kind: "oci", image: s.image };
  if (s.tenantId !== undefined) input.tenantId = s.tenantId;
  if (s.registryAuth !== undefined) input.registryAuth = s.registryAuth;
  if (s.ready?.cmd) input.readyCmd = ["/bin/sh", "-c", s.ready.cmd];
  if (s.ready?.http_timeout_s !== undefined) input.readyTimeoutMs = s.ready.http_timeout_s * 1000;
  if (s.ready?.env) input.readyEnv = s.ready.env;
  if (s.ready?.ports) input.exposedPorts = [...new Set(s.ready.ports)];
  return input;
}
