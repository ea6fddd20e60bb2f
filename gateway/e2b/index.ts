/**
 * The E2B-compatible surface (docs/e2b.md): E2B's SDK, unmodified, pointed at sandboxd.
 *
 * - Control plane under `/e2b` (`E2B_API_URL=<origin>/e2b`): E2B's REST paths mapped onto the
 *   sandboxes API's core (control.ts), authenticated by `X-API-KEY` (a sandboxd key, native or in
 *   E2B form: contracts/e2b/ids.ts).
 * - Data plane ("envd", envd/): E2B's Connect services and `/files`, reached either under
 *   `/e2b/envd` with the sandbox named by the `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers
 *   (`E2B_SANDBOX_URL=<origin>/e2b/envd`, one URL for every sandbox, no DNS), or on a host
 *   `<port>-<id>.<domain>` (E2B's own form, for preview URLs), any path.
 *
 * Both are mounted before the `/v1` key middleware: each authenticates in its own way.
 */
import type { Hono } from "hono";
import type { Deps, HonoEnv } from "../deps.ts";
import { e2bControlRoutes } from "./control.ts";
import { envdHostRouting, envdRoutes } from "./envd/index.ts";
import type { E2bMountDeps } from "./mount.ts";
import { SandboxEnvs } from "./sandbox-envs.ts";

/** Mounts the E2B surface on `app` (the host routing first: it answers any path on such a host). */
export function mountE2b(app: Hono<HonoEnv>, deps: Deps, input: Omit<E2bMountDeps, "envs">): void {
  const m: E2bMountDeps = { ...input, envs: new SandboxEnvs() };
  const envd = envdRoutes(deps, m);
  app.use("*", envdHostRouting(deps, envd));
  app.route("/e2b/envd", envd);
  app.route("/e2b", e2bControlRoutes(deps, m));
}
