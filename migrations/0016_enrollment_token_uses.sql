-- Enrollment tokens that enroll several agents (`agent-token create --uses N`, a DaemonSet's
-- pods: docs/agent-api.md "Enrollment"): the most enrollments a token makes and how many it
-- made. Tokens made before this are single use; one already redeemed has made its one.
ALTER TABLE "agent_enrollment_tokens" ADD COLUMN "uses" integer DEFAULT 1 NOT NULL;--> statement-breakpoint
ALTER TABLE "agent_enrollment_tokens" ADD COLUMN "use_count" integer DEFAULT 0 NOT NULL;--> statement-breakpoint
UPDATE "agent_enrollment_tokens" SET "use_count" = 1 WHERE "used_at" IS NOT NULL;
