/**
 * The two sides of `sandboxd sbx cp SRC DST`, from the command line: a sandbox side is
 * `ID:/absolute/path`, `-` is stdin or stdout, anything else a local path. Pure: no I/O but the
 * directory check the caller passes in.
 */
import { basename, join } from "node:path";
import { type CommandSpec, UsageError } from "./args.ts";

export type Endpoint =
  | { kind: "stdio" }
  | { kind: "local"; path: string }
  | { kind: "sandbox"; id: string; path: string };

/** `sbx_...:PATH`; the id's form is the API's (contracts/api/common.ts SandboxId). */
const SANDBOX_SIDE = /^(sbx_[A-Za-z0-9]+):(.*)$/;

export function parseEndpoint(word: string, spec: CommandSpec): Endpoint {
  if (word === "-") return { kind: "stdio" };
  const m = SANDBOX_SIDE.exec(word);
  if (!m) {
    if (word === "") throw new UsageError("an empty path", spec.name);
    return { kind: "local", path: word };
  }
  const path = m[2]!;
  if (!path.startsWith("/")) throw new UsageError(`a sandbox path must be absolute, got ${word}`, spec.name);
  return { kind: "sandbox", id: m[1]!, path };
}

export interface CopyPlan {
  from: Endpoint;
  to: Endpoint;
  /** Into the sandbox (`to` is the sandbox side), else out of it. */
  upload: boolean;
}

/** Checks the pair: exactly one side in a sandbox. */
export function parseCopy(src: string, dst: string, spec: CommandSpec): CopyPlan {
  const from = parseEndpoint(src, spec);
  const to = parseEndpoint(dst, spec);
  if (from.kind === "sandbox" && to.kind === "sandbox") {
    throw new UsageError("both sides are in sandboxes; copy through a local file", spec.name);
  }
  if (from.kind !== "sandbox" && to.kind !== "sandbox") {
    throw new UsageError("one side must be in a sandbox (ID:/path)", spec.name);
  }
  if (to.kind === "sandbox") {
    if (from.kind === "stdio" && to.path.endsWith("/")) {
      throw new UsageError("stdin has no file name: give the whole sandbox path", spec.name);
    }
    // Into a sandbox directory named with a trailing slash: the local file's name, as cp does.
    if (from.kind === "local")
      return { from, to: { ...to, path: landing(to.path, basename(from.path), () => false) }, upload: true };
    return { from, to, upload: true };
  }
  return { from, to, upload: false };
}

/** Where a file named `name` lands at `dst`: inside it when it names a directory. */
export function landing(dst: string, name: string, isDir: (p: string) => boolean): string {
  return dst.endsWith("/") || isDir(dst) ? join(dst, name) : dst;
}
