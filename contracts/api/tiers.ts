/**
 * Tiers and APIs (docs/keys-and-auth.md "Rules of authentication"): every API key has a tier, and the tier decides the API
 * of endpoints the key may call. Below the rest of the public contract: limits.ts keys its
 * per-tier tables by `Tier`, common.ts reads the tier out of an API key.
 */
import { z } from "zod";

export const Tier = z.enum(["live", "scale", "demo", "pro", "enterprise"]);
export type Tier = z.infer<typeof Tier>;

/** The sessions API = stateless exec, sessions, uploaded templates; The sandboxes API = sandboxes, catalog, Pro. */
export type KeyApi = "sessions" | "sandboxes";
export const API_OF_TIER: Readonly<Record<Tier, KeyApi>> = {
  live: "sessions",
  scale: "sessions",
  demo: "sandboxes",
  pro: "sandboxes",
  enterprise: "sandboxes",
};

/**
 * Tier ranks for "at least this tier" checks: live = demo < scale = pro < enterprise.
 * The API does not map sessions API tiers to sandboxes API ones (docs/keys-and-auth.md "Rules of
 * authentication"); the ranks only compare tiers within one API, and the equalities record that each API has a standard and an
 * admin/paid level.
 */
export const TIER_RANK: Readonly<Record<Tier, number>> = {
  live: 0,
  demo: 0,
  scale: 1,
  pro: 1,
  enterprise: 2,
};

export function tierAtLeast(tier: Tier, min: Tier): boolean {
  return API_OF_TIER[tier] === API_OF_TIER[min] && TIER_RANK[tier] >= TIER_RANK[min];
}
