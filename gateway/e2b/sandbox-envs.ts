/**
 * A sandbox's own environment (E2B's `envVars` at create; docs/e2b.md "Control plane"): variables
 * every process started through the data plane gets, under the call's own `envs`. sandboxd has no
 * such field on a sandbox, so the environment lives in the sandbox itself, as a file of root's
 * (`SANDBOX_ENVS_PATH`), written once at create: it is suspended, resumed, forked and snapshotted
 * with the sandbox's disk, with no table and no record field, and it ends with the sandbox.
 * Each gateway keeps what it read or wrote in memory (`SandboxEnvs`, bounded), so a Start does
 * not read the file each time; a gateway that has not seen the sandbox reads it once.
 */
import { SandboxdError } from "../../contracts/errors.ts";
import { agentOf, inTermsOf, type SandboxRow } from "../core/sandboxes.ts";
import type { Deps } from "../deps.ts";

/** Where a sandbox's environment is kept, in the guest: root's, beside nothing of the image's. */
export const SANDBOX_ENVS_PATH = "/etc/sandboxd/e2b-envs.json";
/**
 * Sandboxes whose environment one gateway remembers. 10,000: a few hundred bytes each (most are
 * empty), and the oldest forgotten is only read again from its sandbox.
 */
const MAX_REMEMBERED = 10_000;
/**
 * The file is read back at most this large: what `envVars` may be at create (MAX_EXEC_ENV_BYTES)
 * as JSON, with room for escaping. A larger file (changed inside the sandbox) is refused.
 */
const MAX_FILE_BYTES = 512 * 1024;

export type EnvMap = Record<string, string>;

export class SandboxEnvs {
  private readonly known = new Map<string, EnvMap>();

  private remember(sandboxId: string, envs: EnvMap): void {
    this.known.delete(sandboxId);
    this.known.set(sandboxId, envs);
    if (this.known.size > MAX_REMEMBERED) this.known.delete(this.known.keys().next().value!);
  }

  /** Writes a new sandbox's environment into it (nothing for an empty one). */
  async write(deps: Deps, row: SandboxRow, envs: EnvMap): Promise<void> {
    this.remember(row.id, envs);
    if (Object.keys(envs).length === 0) return;
    const bytes = new TextEncoder().encode(JSON.stringify(envs));
    const body = new ReadableStream<Uint8Array>({
      start(ctl) {
        ctl.enqueue(bytes);
        ctl.close();
      },
    });
    await inTermsOf(
      row,
      agentOf(deps, row).files(row.vmId!, {
        op: "upload",
        path: SANDBOX_ENVS_PATH,
        user: "root",
        body,
        signal: AbortSignal.timeout(60_000), // the agent's own upload deadline bounds it too
      }),
    );
  }

  /** The sandbox's environment: remembered, else read from the sandbox (none: empty). */
  async of(deps: Deps, row: SandboxRow): Promise<EnvMap> {
    const hit = this.known.get(row.id);
    if (hit) return hit;
    const envs = await readEnvs(deps, row);
    this.remember(row.id, envs);
    return envs;
  }
}

async function readEnvs(deps: Deps, row: SandboxRow): Promise<EnvMap> {
  let body: ReadableStream<Uint8Array>;
  try {
    const a = await inTermsOf(
      row,
      agentOf(deps, row).files(row.vmId!, {
        op: "download",
        path: SANDBOX_ENVS_PATH,
        user: "root",
        signal: AbortSignal.timeout(60_000), // as for the write
      }),
    );
    if (a.op !== "download")
      throw new SandboxdError("internal", "the agent answered a download with something else");
    body = a.body;
  } catch (err) {
    if (err instanceof SandboxdError && err.code === "not_found") return {};
    throw err;
  }
  const chunks: Uint8Array[] = [];
  let size = 0;
  for await (const chunk of body) {
    size += chunk.byteLength;
    if (size > MAX_FILE_BYTES)
      throw new SandboxdError("invalid_file", `${SANDBOX_ENVS_PATH} is larger than ${MAX_FILE_BYTES} bytes`);
    chunks.push(chunk);
  }
  let parsed: unknown;
  try {
    parsed = JSON.parse(Buffer.concat(chunks).toString("utf8"));
  } catch {
    // The sandbox's own file, changed from inside: its processes start with no environment of it.
    return {};
  }
  if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) return {};
  const out: EnvMap = {};
  for (const [k, v] of Object.entries(parsed)) if (typeof v === "string") out[k] = v;
  return out;
}
