/**
 * What a tenant is told about a failed build: a stable code, a short reason and an error id; the
 * agent logs the whole cause chain (tool stderr, host paths, registry URLs) under the same id.
 *
 * The reason is the failing error's own message only where the layer that threw it writes that
 * message for the tenant: a pull (the reference they gave and a classified reason,
 * agent/image/pull.ts), the checks of an image's contents (names inside their archive, never a
 * host path), a ready command that failed (their own command). Every other failure (a QEMU that
 * did not start, a host tool, a missing file) gets a fixed text per code, because its message
 * quotes what the host said.
 */
import { randomBytes } from "node:crypto";
import { type ErrorCode, ImageErrorCode, SandboxdError } from "../../contracts/errors.ts";

/** Codes whose message the thrower wrote for the tenant. */
const OWN_WORDS = new Set<ErrorCode>([
  ...ImageErrorCode.filter((c) => c !== "image_not_found" && c !== "image_tool_failed"),
  "image_pull_failed",
  "template_ready_failed",
  "bad_request",
  "gone",
]);

/** Fixed texts for failures whose message is the host's. */
const FIXED: Partial<Record<ErrorCode, string>> = {
  image_not_found: "the image source is missing on the agent",
  image_tool_failed: "the image could not be converted",
  template_build_failed: "the template VM did not start or could not be saved",
  vm_launch_failed: "the template VM did not start",
  spawn_failed: "the template VM did not start",
  bringup_timeout:
    "the template VM did not come up within its wait (wait_secs, else the agent's bring-up default)",
  insufficient_storage: "the agent's disk has no room for this build; retry once space is freed",
};

/** A fresh id naming one failure in the agent's log, e.g. `err-3f9a1c0b2e4d`. */
export function newErrorId(): string {
  return `err-${randomBytes(6).toString("hex")}`;
}

/** `code: reason (error id ID)` for a template's `error` field. */
export function tenantErrorText(err: unknown, errorId: string): string {
  const [code, reason] = tenantReason(err);
  return `${code}: ${reason} (error id ${errorId})`;
}

function tenantReason(err: unknown): [code: string, reason: string] {
  if (!(err instanceof SandboxdError)) return ["internal", "the build failed on the agent"];
  const detail = err.details?.reason;
  const code = typeof detail === "string" ? detail : err.code;
  if (OWN_WORDS.has(err.code)) return [code, err.message];
  return [code, FIXED[err.code] ?? "the build failed on the agent"];
}
