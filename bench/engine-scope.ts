/**
 * What one engine run made (VMs, its template, its scratch dirs), so that an error or an abort
 * frees all of it, and the two waits every step uses: an abortable sleep and a `true` in the guest.
 */
import { rm } from "node:fs/promises";
import type { ImageConfig } from "../agent/image/import.ts";
import { deleteTemplate, type TemplateMeta } from "../agent/snapshot/template.ts";
import type { SandboxVm } from "../agent/snapshot/vm.ts";
import { forgetChainStore } from "../agent/storage/chain.ts";
import { killQemusNaming } from "../agent/vm/process.ts";
import { bestEffort, settled } from "../contracts/best-effort.ts";
import { SandboxdError } from "../contracts/errors.ts";

/** Guest-side limit of one `true`: it answers in milliseconds; 20 s means the guest is gone. */
const EXEC_TIMEOUT_MS = 20_000;

export class Interrupted extends Error {
  constructor() {
    super("benchmark interrupted");
    this.name = "Interrupted";
  }
}

interface Destroyable {
  destroy(): Promise<void>;
}

/** Cleanup failures go to stderr: stdout carries the run's JSON. */
const logToStderr = (m: string) => process.stderr.write(`${m}\n`);

/** What the run made, so that an error or an abort frees all of it. */
export class Scope {
  readonly vms = new Set<Destroyable>();
  template: TemplateMeta | undefined;
  constructor(
    readonly dataDir: string,
    readonly shmRoot: string,
    readonly signal: AbortSignal | undefined,
  ) {}

  get aborted(): boolean {
    return this.signal?.aborted ?? false;
  }

  check(): void {
    if (this.aborted) throw new Interrupted();
  }

  track<T extends Destroyable>(vm: T): T {
    this.vms.add(vm);
    if (this.aborted) {
      void settled(this.release(vm)); // cleanup() retries what is left and reports it
      throw new Interrupted();
    }
    return vm;
  }

  async release(vm: Destroyable): Promise<void> {
    this.vms.delete(vm);
    await vm.destroy();
  }

  /** Re-runnable: frees whatever exists now (a step still in flight may add more; run again after it). */
  async cleanup(): Promise<void> {
    await Promise.allSettled([...this.vms].map((vm) => this.release(vm)));
    if (this.template) {
      const id = this.template.id;
      this.template = undefined;
      await bestEffort(logToStderr, `deleting bench template ${id}`, deleteTemplate(this.dataDir, id));
    }
    // A QEMU started by a step that was still in flight is not tracked yet: its command line
    // names our scratch dirs (unique to this run), which is how we find it.
    await killQemusNaming([this.dataDir, this.shmRoot]);
    forgetChainStore(this.dataDir);
    await rm(this.dataDir, { recursive: true, force: true });
    await rm(this.shmRoot, { recursive: true, force: true });
  }
}

export function sleep(ms: number, scope: Scope): Promise<void> {
  scope.check();
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done() {
      clearTimeout(t);
      scope.signal?.removeEventListener("abort", done);
      resolve();
    }
    scope.signal?.addEventListener("abort", done, { once: true });
  });
}

export type Execer = { exec: SandboxVm["exec"] };

/** Runs `true` as the image's config says; anything but exit 0 is an error. Returns wall ms. */
export async function runTrue(vm: Execer, config: ImageConfig): Promise<number> {
  const t0 = performance.now();
  const r = await vm.exec({ argv: ["true"], env: config.env, cwd: "/", timeoutMs: EXEC_TIMEOUT_MS });
  const ms = performance.now() - t0;
  if (r.exitCode !== 0)
    throw new SandboxdError(
      "internal",
      `\`true\` in the guest ${r.timedOut ? "timed out" : `exited ${r.exitCode ?? `by signal ${r.signal}`}`}: ` +
        r.stderr.toString("utf8").slice(-500),
    );
  return ms;
}

/** Whether runBench rejected because its signal aborted it. */
export function isInterrupted(err: unknown): boolean {
  return err instanceof Interrupted;
}
