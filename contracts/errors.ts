/**
 * One error tree for the whole service. A failure that leaves a module is a `SandboxdError` (or a
 * subclass) whose `code` is one of the unions below, so a misspelt code does not compile; callers
 * branch on `code` (or on the subclass), never on message text.
 *
 *   Error
 *   ├── SandboxdError                  contracts/errors.ts    code: ErrorCode (below)
 *   │   ├── QmpError                   agent/qemu/qmp/errors.ts   qmp_error, qmp_timeout,
 *   │   │                                qmp_disconnected, qmp_protocol (one subclass each)
 *   │   ├── GuestError                 agent/guest/codec.ts   guest_disconnected, guest_timeout,
 *   │   │                                protocol_error, guest_error
 *   │   ├── VmLaunchError              agent/qemu/launch.ts   vm_launch_failed
 *   │   ├── StorageError               agent/storage/chain.ts   storage_error
 *   │   ├── ImageError                 agent/image/errors.ts   image_*
 *   │   └── SnapshotError              agent/snapshot/errors.ts   its own codes and some public
 *   │                                    ones; RETURNED in a Result<T>, see the rule below
 *   ├── ToolError                      agent/host/tool.ts   a host tool failed (`kind`); its
 *   │                                    caller wraps it in its own error, keeping it as `cause`
 *   ├── GuestArtifactsError            agent/guest/artifacts-common.ts guest kernel/initrd setup, for
 *   │                                    the CLI and tests; never reaches the API
 *   ├── ImageReferenceError            contracts/image-ref.ts   the gateway answers bad_request
 *   └── EgressRefused, TarFormatError  private to one module; never leave it
 *
 * How a code becomes what a client sees (the only places codes are translated):
 *
 *   agent layer codes (InternalErrorCode)
 *     │  the layer above restates a failure it understands as an AgentErrorCode: a guest_error on a
 *     │  tunnel connect is port_unreachable, a guest hang-up after QEMU died is gone
 *     │  (agent/sandbox/manager.ts), a failed restore is spawn_failed (agent/sandbox/drivers/snapshot.ts)
 *     ▼
 *   AgentErrorCode ── agent/api/errors.ts AGENT_STATUS_OF_CODE ──> the agent's HTTP answer;
 *     │  any other code (qmp_*, guest_*, image_*, vm_*, ...) is sent as 500 `internal` with the
 *     │  readable cause chain as message
 *     ▼
 *   gateway/agents/client.ts: the same code again, as a SandboxdError in the gateway; an agent
 *     │  that does not answer is `agent_unavailable`
 *     ▼
 *   gateway/errors.ts mapError ──> PublicErrorCode and HTTP status: public codes as they are;
 *      the agent's own codes through PUBLIC_OF_AGENT_CODE (unsupported -> not_implemented);
 *      everything else a bare 500 `internal` whose message is logged, not sent
 *
 * Result<T> or throw: one layer returns its failures, the snapshot engine (agent/snapshot/):
 * every public operation answers `Result<T>` (agent/snapshot/errors.ts) holding a SnapshotError.
 * A failed save, restore or fork leaves QEMU processes and files that only the caller can settle
 * (kill the VM, keep it running, keep the snapshot), so the type makes its one caller, the
 * snapshot driver (agent/sandbox/drivers/snapshot.ts), handle every failure where it happens; the
 * driver throws from there on. Every other layer throws SandboxdError or a subclass. Checks that
 * answer a question rather than do something return their refusal as a value for the caller to
 * throw (`verifyAgentToken`, the state tables' `checkRecordAction`, `checkTransition` and `checkVmTransition`).
 */

/**
 * The codes of the public API (docs/api.md "Rules every route shares"); contracts/api/error-status.ts
 * gives each its status, for the gateway (gateway/errors.ts) and the edge (edge/).
 */
export const PublicErrorCode = [
  "bad_request",
  "unauthorized",
  "forbidden",
  "demo_tier_limit",
  "not_found",
  "gone",
  "busy",
  "template_in_use",
  "template_not_ready",
  "conflict",
  "port_not_exposed",
  /**
   * A create asked for a size its template (or snapshot) does not have (docs/templates.md "Size
   * classes"); `details.sizes` lists the ones it has.
   */
  "size_unavailable",
  /** The guest refused a file of an exec's `files` (bad path, permission, its disk full). */
  "invalid_file",
  /** A connect reached the sandbox but nothing accepts connections on the port inside it. */
  "port_unreachable",
  "payload_too_large",
  /** The edge (edge/): the key names a region the edge has no gateways for. */
  "unknown_region",
  "rate_limited",
  "quota_exceeded",
  "at_capacity",
  /** The host's disk (or tmpfs) lacks the room a write needs plus its reserve (contracts/disk-space.ts). */
  "insufficient_storage",
  "agent_unavailable",
  "db_unavailable",
  /** The edge (edge/): no gateway of the request's region answered. */
  "gateway_unavailable",
  "not_implemented",
  "spawn_failed",
  "bringup_timeout",
  "internal",
] as const;
export type PublicErrorCode = (typeof PublicErrorCode)[number];

/**
 * Every code an agent puts on its wire (docs/agent-api.md "Errors"); agent/api/errors.ts gives each
 * its status. Most are public codes with the same meaning; `unsupported` is the agent's own.
 */
export const AgentErrorCode = [
  "bad_request",
  "unauthorized",
  "not_found",
  "gone",
  "busy",
  "conflict",
  "template_in_use",
  "template_not_ready",
  "port_not_exposed",
  /** A tunnel's connect inside the guest failed (nothing listens: ECONNREFUSED, ...). */
  "port_unreachable",
  "invalid_file",
  "payload_too_large",
  /** The driver cannot do this at all (fork/suspend on a cold-boot agent). */
  "unsupported",
  "at_capacity",
  "insufficient_storage",
  "spawn_failed",
  "bringup_timeout",
  "internal",
] as const;
export type AgentErrorCode = (typeof AgentErrorCode)[number];

/*
 * The codes of the agent's layers, which never cross its wire (they go out as `internal`). Each
 * layer's union is defined here, once, and imported by the layer, whose error class says what
 * each code means where it is thrown.
 */

/** QmpError, agent/qemu/qmp/errors.ts. */
export const QmpErrorCode = ["qmp_error", "qmp_timeout", "qmp_disconnected", "qmp_protocol"] as const;
export type QmpErrorCode = (typeof QmpErrorCode)[number];

/** GuestError, agent/guest/codec.ts. */
export const GuestErrorCode = [
  "guest_disconnected",
  "guest_timeout",
  "protocol_error",
  "guest_error",
] as const;
export type GuestErrorCode = (typeof GuestErrorCode)[number];

/** ImageError, agent/image/errors.ts (one comment per code there); image_pull_failed: agent/image/pull.ts. */
export const ImageErrorCode = [
  "image_not_found",
  "image_not_tar",
  "image_no_manifest",
  "image_bad_manifest",
  "image_bad_config",
  "image_bad_layer",
  "image_unsupported",
  "image_path_escape",
  "image_link_escape",
  "image_too_large",
  "image_digest_mismatch",
  "image_user_unknown",
  "image_no_command",
  "image_tool_failed",
] as const;
export type ImageErrorCode = (typeof ImageErrorCode)[number];

/** SnapshotError's own codes, agent/snapshot/errors.ts (it also carries some public ones). */
export const SnapshotOwnErrorCode = [
  "template_build_failed",
  "template_ready_failed",
  "template_not_found",
  "fork_failed",
  "suspend_failed",
  "invalid_state",
  "vm_died",
  "vm_unresponsive",
  "migration_failed",
  "vm_record_invalid",
  // a copied template frozen under another guest kernel, accelerator or QEMU (snapshot/template-copy.ts)
  "template_incompatible",
] as const;
export type SnapshotOwnErrorCode = (typeof SnapshotOwnErrorCode)[number];

export const InternalErrorCode = [
  ...QmpErrorCode,
  ...GuestErrorCode,
  ...ImageErrorCode,
  "image_pull_failed",
  ...SnapshotOwnErrorCode,
  // VmLaunchError, agent/qemu/launch.ts: QEMU exited or never answered while starting
  "vm_launch_failed",
  // a VM found after an agent restart could not be re-adopted (agent/sandbox/drivers/)
  "vm_lost",
  // StorageError, agent/storage/chain.ts
  "storage_error",
  // the catalog image build (agent/catalog/python.ts)
  "catalog_build_failed",
] as const;
export type InternalErrorCode = (typeof InternalErrorCode)[number];

/** Every code a SandboxdError may carry. */
export type ErrorCode = PublicErrorCode | AgentErrorCode | InternalErrorCode;

export class SandboxdError extends Error {
  readonly code: ErrorCode;
  readonly details: Record<string, unknown> | undefined;
  constructor(
    code: ErrorCode,
    message: string,
    opts?: { cause?: unknown; details?: Record<string, unknown> },
  ) {
    super(message, opts?.cause === undefined ? undefined : { cause: opts.cause });
    this.name = "SandboxdError";
    this.code = code;
    this.details = opts?.details;
  }
}

/**
 * The readable chain of causes, for logs and CLI output. A cause whose message its parent already
 * quotes (a layer wrapping a ToolError with the tool's own words) adds nothing and is left out.
 */
export function describeError(err: unknown): string {
  const parts: string[] = [];
  let cur: unknown = err;
  let parentMessage: string | undefined;
  for (let depth = 0; cur !== undefined && cur !== null && depth < 5; depth++) {
    if (cur instanceof Error) {
      const code = (cur as { code?: unknown }).code;
      if (!(parentMessage !== undefined && cur.message !== "" && parentMessage.includes(cur.message)))
        parts.push(typeof code === "string" ? `${cur.message} [${code}]` : cur.message);
      parentMessage = cur.message;
      cur = cur.cause;
    } else {
      parts.push(String(cur));
      break;
    }
  }
  return parts.join(": caused by: ");
}
