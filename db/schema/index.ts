/** All tables; drizzle-kit reads this file (drizzle.config.ts). */
export * from "./agents.ts";
export * from "./api-keys.ts";
export * from "./dial-links.ts";
export * from "./fleet-secrets.ts";
export * from "./rate-windows.ts";
export * from "./sandboxes.ts";
export * from "./snapshots.ts";
export * from "./templates.ts";
export * from "./tenants.ts";
export * from "./usage-intervals.ts";
