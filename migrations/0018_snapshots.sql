-- Snapshots a tenant keeps: the memory and disk of one of its sandboxes at one instant, kept on
-- the agent that took it. A deleted snapshot keeps its row (deleted_at) for the sandboxes whose
-- snapshot_id names it. Lists read the tenant's newest first (snapshots_tenant_list_idx).
CREATE TABLE "snapshots" (
	"id" text PRIMARY KEY NOT NULL,
	"tenant_id" text NOT NULL,
	"source_sandbox_id" text NOT NULL,
	"agent_id" text NOT NULL,
	"template_pk" text NOT NULL,
	"template_id" text NOT NULL,
	"state" text NOT NULL,
	"name" text,
	"labels" jsonb DEFAULT '{}'::jsonb NOT NULL,
	"size_bytes" bigint,
	"vcpus" integer,
	"mem_mib" integer,
	"disk_bytes" bigint,
	"error" text,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"ready_at" timestamp with time zone,
	"deleted_at" timestamp with time zone
);
--> statement-breakpoint
ALTER TABLE "snapshots" ADD CONSTRAINT "snapshots_tenant_id_tenants_id_fk" FOREIGN KEY ("tenant_id") REFERENCES "public"."tenants"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
CREATE INDEX "snapshots_tenant_list_idx" ON "snapshots" USING btree ("tenant_id","created_at","id");