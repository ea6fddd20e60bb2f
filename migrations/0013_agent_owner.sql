-- BYOC agents for one tenant (docs/regions.md "BYOC agents: who dials whom"): the tenant an
-- enrollment token gives the agent it enrolls, and the agent's owner. Agents and tokens made
-- before this have none (null): operators' agents, for every tenant.
ALTER TABLE "agent_enrollment_tokens" ADD COLUMN "owner_tenant" text;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "owner_tenant" text;