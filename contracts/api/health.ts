/** `GET /v1/health` (docs/api.md "Rules every route shares"): one object that satisfies both the sessions and sandboxes API forms. */
import { z } from "zod";
import { TemplateReadyMap } from "./sessions-api.ts";

/**
 * What the service says wherever it reports TCG (health, `doctor`, the agent's start-up line):
 * QEMU's security policy treats only hardware virtualization (KVM) as a security boundary.
 */
export const TCG_BOUNDARY =
  "the VM boundary is TCG (software emulation), which QEMU's security policy does not treat as a security boundary; each QEMU's jail is the boundary that remains";

export const HealthResponse = z
  .object({
    status: z
      .enum(["ok", "degraded", "starting"])
      .describe(
        "`starting` (with HTTP 503) until this gateway has seen an agent of its region live: `sandboxd up` answers `ok` only once its own agent has registered. After that, `degraded` (HTTP 200) when no agent or the database answers (then `templates` is empty).",
      ),
    reason: z.string().optional().describe("Present when `status` is not `ok`: what is missing."),
    version: z.string().describe("API build stamp (sandboxes API form)."),
    templates: TemplateReadyMap.describe("Public templates and readiness (sessions API form)."),
    accel: z
      .enum(["kvm", "tcg"])
      .optional()
      .describe(
        "How VMs run: `kvm` (hardware virtualization) or `tcg` (software emulation). `tcg` when any host runs TCG. Absent when no host answers.",
      ),
    vm_boundary: z
      .string()
      .optional()
      .describe(
        "Present under TCG: says that the VM boundary is software emulation, which QEMU's security policy does not treat as a security boundary.",
      ),
    settings: z
      .record(z.string(), z.union([z.number(), z.string()]))
      .optional()
      .describe(
        "The operator settings in force in this gateway process, by environment name (e.g. `SANDBOXD_SESSION_IDLE_TTL`): limits, quotas and deadlines (numbers) and the idle action (a word), never a secret. `sandboxd up` also shows its agent's.",
      ),
  })
  .meta({ id: "HealthResponse" });
export type HealthResponse = z.infer<typeof HealthResponse>;
