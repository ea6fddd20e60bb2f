/** Tier and family checks (spec 5.3, 5.4, 5.6). */
import { type Family, type Tier, tierAtLeast } from "../../contracts/api/tiers.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Principal } from "./keys.ts";

const FAMILY_KEYS: Record<Family, string> = { a: "a live or scale key", b: "a demo, pro or enterprise key" };

export function requireFamily(p: Principal, family: Family): void {
  if (p.family !== family) {
    throw new SandboxdError(
      "forbidden",
      `this endpoint needs ${FAMILY_KEYS[family]}; this is a ${p.tier} key`,
    );
  }
}

/** Family A template admin needs `scale`: 403 `forbidden`. */
export function requireScale(p: Principal): void {
  requireFamily(p, "a");
  if (!tierAtLeast(p.tier, "scale")) {
    throw new SandboxdError("forbidden", "registering or deleting templates needs a scale key");
  }
}

/** Family B Pro features: 403 `demo_tier_limit` for demo keys (spec 5.4, 7). */
export function requirePro(p: Principal, feature: string): void {
  requireFamily(p, "b");
  if (!tierAtLeast(p.tier, "pro")) {
    throw new SandboxdError("demo_tier_limit", `${feature} needs a pro or enterprise key`);
  }
}

export type { Tier };
