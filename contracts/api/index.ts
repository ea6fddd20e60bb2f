/** The public API contract: every request and response schema of both families. */
export * from "./common.ts";
export * from "./family-a.ts";
export * from "./family-b.ts";
export * from "./health.ts";
export * from "./limits.ts";
export * from "./routes.ts";
export * from "./tiers.ts";
