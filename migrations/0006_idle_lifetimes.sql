ALTER TABLE "sandboxes" ADD COLUMN "idle_timeout_s" integer;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD COLUMN "idle_action" text;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD COLUMN "suspended_by" text;