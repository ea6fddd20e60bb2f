/**
 * Tiers and families (spec section 5): every API key has a tier, and the tier decides the family
 * of endpoints the key may call. Below the rest of the public contract: limits.ts keys its
 * per-tier tables by `Tier`, common.ts reads the tier out of an API key.
 */
import { z } from "zod";

export const Tier = z.enum(["live", "scale", "demo", "pro", "enterprise"]);
export type Tier = z.infer<typeof Tier>;

/** Family A = stateless exec, sessions, uploaded templates; Family B = sandboxes, catalog, Pro. */
export type Family = "a" | "b";
export const FAMILY_OF_TIER: Readonly<Record<Tier, Family>> = {
  live: "a",
  scale: "a",
  demo: "b",
  pro: "b",
  enterprise: "b",
};

/**
 * Tier ranks for "at least this tier" checks: live = demo < scale = pro < enterprise.
 * The spec does not map Family A tiers to Family B ones (section 5.8); the ranks only compare
 * tiers within a family, and the equalities record that each family has a standard and an
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
  return FAMILY_OF_TIER[tier] === FAMILY_OF_TIER[min] && TIER_RANK[tier] >= TIER_RANK[min];
}
