/** `GET /v1/health` (spec 2.10): one object that satisfies both the Family A and B forms. */
import { z } from "zod";
import { TemplateReadyMap } from "./family-a.ts";

export const HealthResponse = z
  .object({
    status: z
      .enum(["ok", "degraded"])
      .describe(
        "`degraded` when the host agent or the database does not answer (then `templates` is empty).",
      ),
    version: z.string().describe("API build stamp (Family B form)."),
    templates: TemplateReadyMap.describe("Public templates and readiness (Family A form)."),
  })
  .meta({ id: "HealthResponse" });
export type HealthResponse = z.infer<typeof HealthResponse>;
