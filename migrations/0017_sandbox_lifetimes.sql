-- Absolute lifetimes of sandboxes (timeout_s, expires_at, on_timeout), the snapshot a sandbox
-- was created from, and the indexes the deadline timer and paged lists read. Existing rows have
-- no absolute lifetime and come from templates.
ALTER TABLE "sandboxes" ADD COLUMN "timeout_s" integer;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD COLUMN "expires_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD COLUMN "on_timeout" text;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD COLUMN "snapshot_id" text;--> statement-breakpoint
CREATE INDEX "sandboxes_expires_idx" ON "sandboxes" USING btree ("expires_at");--> statement-breakpoint
CREATE INDEX "sandboxes_tenant_list_idx" ON "sandboxes" USING btree ("tenant_id","api","created_at","id");