/**
 * The build stamp `GET /v1/health` reports as `version` (docs/api.md "Rules every route shares"): the package version and the
 * commit the code is, `<version>+<commit>`. The commit comes from `git rev-parse` in a checkout;
 * a copy without `.git` (an image or tarball made from a checkout) reads `.build-stamp`, which
 * `bin/sandboxd` writes beside the code whenever it starts in a checkout; with neither it is
 * `unknown`. Computed once at start.
 */
import { spawnSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";

/** The file `bin/sandboxd` writes: one line, the commit. */
export const BUILD_STAMP_FILE = ".build-stamp";

/** What a commit looks like here (abbreviated or full hex); anything else is not one. */
const COMMIT = /^[0-9a-f]{7,40}$/;
/** `git rev-parse` answers from local files in milliseconds; 5 s means git is stuck (a hung NFS). */
const GIT_TIMEOUT_MS = 5_000;

export function buildCommit(root: string): string {
  if (existsSync(join(root, ".git"))) {
    const r = spawnSync("git", ["-C", root, "rev-parse", "--short=12", "HEAD"], {
      encoding: "utf8",
      timeout: GIT_TIMEOUT_MS,
      stdio: ["ignore", "pipe", "ignore"],
    });
    const out = r.status === 0 ? r.stdout.trim() : "";
    if (COMMIT.test(out)) return out;
  }
  try {
    const stamped = readFileSync(join(root, BUILD_STAMP_FILE), "utf8").trim();
    if (COMMIT.test(stamped)) return stamped;
  } catch {
    // no stamp: not built from a checkout
  }
  return "unknown";
}

/** `<package version>+<commit>` (semver build metadata), e.g. `0.1.0+3ef7554a1b2c`. */
export function buildVersion(root: string, packageVersion: string): string {
  return `${packageVersion}+${buildCommit(root)}`;
}
