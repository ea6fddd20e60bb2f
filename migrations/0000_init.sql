CREATE TABLE "agents" (
	"id" text PRIMARY KEY NOT NULL,
	"region" text NOT NULL,
	"url" text NOT NULL,
	"slots_total" integer DEFAULT 0 NOT NULL,
	"slots_free" integer DEFAULT 0 NOT NULL,
	"vcpus_free" integer DEFAULT 0 NOT NULL,
	"mem_mib_free" integer DEFAULT 0 NOT NULL,
	"last_heartbeat_at" timestamp with time zone,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "api_keys" (
	"id" text PRIMARY KEY NOT NULL,
	"tenant_id" text NOT NULL,
	"tier" text NOT NULL,
	"prefix" text NOT NULL,
	"name" text DEFAULT '' NOT NULL,
	"hash" text NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"revoked_at" timestamp with time zone
);
--> statement-breakpoint
CREATE TABLE "sandboxes" (
	"id" text PRIMARY KEY NOT NULL,
	"tenant_id" text NOT NULL,
	"family" text NOT NULL,
	"kind" text NOT NULL,
	"template_pk" text NOT NULL,
	"template_id" text NOT NULL,
	"agent_id" text NOT NULL,
	"vm_id" text,
	"parent_id" text,
	"state" text NOT NULL,
	"end_reason" text,
	"labels" jsonb DEFAULT '{}'::jsonb NOT NULL,
	"endpoints" jsonb DEFAULT '{}'::jsonb NOT NULL,
	"vcpus" integer DEFAULT 0 NOT NULL,
	"mem_mib" integer DEFAULT 0 NOT NULL,
	"disk_bytes" bigint DEFAULT 0 NOT NULL,
	"exec_count" integer DEFAULT 0 NOT NULL,
	"created_at" timestamp with time zone NOT NULL,
	"last_exec_at" timestamp with time zone,
	"destroyed_at" timestamp with time zone
);
--> statement-breakpoint
CREATE TABLE "templates" (
	"pk" text PRIMARY KEY NOT NULL,
	"id" text NOT NULL,
	"tenant_id" text,
	"family" text NOT NULL,
	"agent_ref" text NOT NULL,
	"name" text NOT NULL,
	"description" text DEFAULT '' NOT NULL,
	"tier" text,
	"image" text,
	"spec" jsonb DEFAULT '{}'::jsonb NOT NULL,
	"status" text NOT NULL,
	"phase" text DEFAULT 'Pending' NOT NULL,
	"error" text,
	"exposed_ports" jsonb DEFAULT '[]'::jsonb NOT NULL,
	"mem_mib" integer,
	"vcpu_count" integer,
	"upload_bytes" bigint,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"ready_at" timestamp with time zone,
	"deleted_at" timestamp with time zone,
	CONSTRAINT "templates_agent_ref_unique" UNIQUE("agent_ref")
);
--> statement-breakpoint
CREATE TABLE "tenants" (
	"id" text PRIMARY KEY NOT NULL,
	"name" text NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "tenants_name_unique" UNIQUE("name")
);
--> statement-breakpoint
CREATE TABLE "usage_intervals" (
	"id" bigserial PRIMARY KEY NOT NULL,
	"sandbox_id" text NOT NULL,
	"tenant_id" text NOT NULL,
	"state" text NOT NULL,
	"vcpus" integer NOT NULL,
	"mem_mib" integer NOT NULL,
	"disk_bytes" bigint NOT NULL,
	"started_at" timestamp with time zone NOT NULL,
	"ended_at" timestamp with time zone
);
--> statement-breakpoint
ALTER TABLE "api_keys" ADD CONSTRAINT "api_keys_tenant_id_tenants_id_fk" FOREIGN KEY ("tenant_id") REFERENCES "public"."tenants"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD CONSTRAINT "sandboxes_tenant_id_tenants_id_fk" FOREIGN KEY ("tenant_id") REFERENCES "public"."tenants"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD CONSTRAINT "sandboxes_template_pk_templates_pk_fk" FOREIGN KEY ("template_pk") REFERENCES "public"."templates"("pk") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "sandboxes" ADD CONSTRAINT "sandboxes_agent_id_agents_id_fk" FOREIGN KEY ("agent_id") REFERENCES "public"."agents"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "templates" ADD CONSTRAINT "templates_tenant_id_tenants_id_fk" FOREIGN KEY ("tenant_id") REFERENCES "public"."tenants"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "usage_intervals" ADD CONSTRAINT "usage_intervals_sandbox_id_sandboxes_id_fk" FOREIGN KEY ("sandbox_id") REFERENCES "public"."sandboxes"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "usage_intervals" ADD CONSTRAINT "usage_intervals_tenant_id_tenants_id_fk" FOREIGN KEY ("tenant_id") REFERENCES "public"."tenants"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
CREATE INDEX "api_keys_tenant_idx" ON "api_keys" USING btree ("tenant_id");--> statement-breakpoint
CREATE INDEX "sandboxes_tenant_state_idx" ON "sandboxes" USING btree ("tenant_id","family","state");--> statement-breakpoint
CREATE INDEX "sandboxes_template_state_idx" ON "sandboxes" USING btree ("template_pk","state");--> statement-breakpoint
CREATE INDEX "sandboxes_state_idle_idx" ON "sandboxes" USING btree ("kind","state","last_exec_at");--> statement-breakpoint
CREATE UNIQUE INDEX "templates_owner_id_uq" ON "templates" USING btree (coalesce("tenant_id", ''),"id") WHERE "templates"."deleted_at" is null;--> statement-breakpoint
CREATE INDEX "templates_id_idx" ON "templates" USING btree ("id");--> statement-breakpoint
CREATE INDEX "usage_tenant_time_idx" ON "usage_intervals" USING btree ("tenant_id","started_at");--> statement-breakpoint
CREATE UNIQUE INDEX "usage_one_open_per_sandbox" ON "usage_intervals" USING btree ("sandbox_id") WHERE "usage_intervals"."ended_at" is null;