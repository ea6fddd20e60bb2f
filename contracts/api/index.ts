/** The public API contract: every request and response schema of both APIs. */
export * from "./api-key.ts";
export * from "./common.ts";
export * from "./health.ts";
export * from "./limits.ts";
export * from "./lists.ts";
export * from "./routes.ts";
export * from "./sandboxes-api.ts";
export * from "./sessions-api.ts";
export * from "./tiers.ts";
