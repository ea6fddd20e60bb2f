ALTER TABLE "sandboxes" ADD COLUMN "hold" text;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD COLUMN "hold_until" timestamp with time zone;