/**
 * Podman for the container tests (tests/e2e/containers.test.ts): builds the images with the
 * project's own script (deploy/images/build.sh, which installs podman, runc and debootstrap when
 * missing) and runs podman with the flags this kind of host needs. Test code only.
 */
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { REPO, runCommand } from "./e2e-service.ts";

/** A cold build: debootstrap (~30 s), the agent's apt installs and guest build (~2 min). */
const BUILD_TIMEOUT_MS = 15 * 60_000;
/** A podman command other than a build: a start, an exec of the CLI, a stop's drain. */
const PODMAN_TIMEOUT_MS = 180_000;

/**
 * runc as the runtime: bookworm's crun (1.8) refuses a host whose cgroup v1 and v2 hierarchies
 * are mounted together, which runc handles (deploy/images/build.sh builds with it too).
 */
const BASE_ARGS = ["--runtime", "runc"];

/**
 * Podman's default rlimits (1,048,576 open files and processes) need CAP_SYS_RESOURCE to raise
 * the limits past the host's; a root without it (a sandboxed CI machine) cannot start a container
 * with them. The containers get the host's own open-file limit and at most 32,768 processes (what
 * conmon, podman's monitor, runs under, and the most its child may keep).
 */
export function ulimitArgs(): string[] {
  const limits = readFileSync("/proc/self/limits", "utf8");
  const hard = (name: string) => {
    const m = new RegExp(`^${name}\\s+\\S+\\s+(\\S+)`, "m").exec(limits);
    return m && m[1] !== "unlimited" ? Number(m[1]) : Number.POSITIVE_INFINITY;
  };
  const nofile = Math.min(hard("Max open files"), 1_048_576);
  const nproc = Math.min(hard("Max processes"), 32_768);
  return ["--ulimit", `nofile=${nofile}:${nofile}`, "--ulimit", `nproc=${nproc}:${nproc}`];
}

export interface PodmanResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

export function podman(args: string[], timeoutMs = PODMAN_TIMEOUT_MS): Promise<PodmanResult> {
  return runCommand("podman", [...BASE_ARGS, ...args], { env: process.env, timeoutMs });
}

/** Synchronous, for cleanup in afterAll (never throws). */
export function podmanSync(args: string[]): PodmanResult {
  const r = spawnSync("podman", [...BASE_ARGS, ...args], { encoding: "utf8", timeout: PODMAN_TIMEOUT_MS });
  return { code: r.status, stdout: r.stdout ?? "", stderr: r.stderr ?? "" };
}

/** Builds (or finds built) both images; their content-addressed names. */
export async function buildImages(): Promise<{ gateway: string; agent: string }> {
  const r = await runCommand(join(REPO, "deploy/images/build.sh"), [], {
    env: process.env,
    timeoutMs: BUILD_TIMEOUT_MS,
  });
  if (r.code !== 0) throw new Error(`deploy/images/build.sh exited ${r.code}: ${r.stderr.slice(-3000)}`);
  const image = (name: string) => {
    const m = new RegExp(`^${name} (\\S+)$`, "m").exec(r.stdout);
    if (!m) throw new Error(`deploy/images/build.sh named no ${name} image: ${r.stdout}`);
    return m[1]!;
  };
  return { gateway: image("gateway"), agent: image("agent") };
}
