-- Regions are data (docs/regions.md "Rules of regions"): a tenant's home region, and the region
-- (and, when pinned, the URL) an enrollment token gives the agent it enrolls. Tenants made before
-- this have no region (null): they are served in the serving gateway's --region. Tokens made
-- before it enroll into 'local', the default region of `up` and `gateway`.
ALTER TABLE "agent_enrollment_tokens" ADD COLUMN "region" text DEFAULT 'local' NOT NULL;--> statement-breakpoint
ALTER TABLE "agent_enrollment_tokens" ADD COLUMN "url" text;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "url_pinned" boolean DEFAULT false NOT NULL;--> statement-breakpoint
ALTER TABLE "tenants" ADD COLUMN "region" text;