/** What the E2B surface's routes share with the rest of the gateway (gateway/e2b/index.ts mounts them). */
import type { VerifiedKeys } from "../auth/key-cache.ts";
import type { KeyRateLimit } from "../auth/rate-limit.ts";
import type { SandboxEnvs } from "./sandbox-envs.ts";

export interface E2bMountDeps {
  keys: VerifiedKeys;
  rateLimit: KeyRateLimit;
  /** The sandboxes' own environments this gateway knows (sandbox-envs.ts). */
  envs: SandboxEnvs;
}
