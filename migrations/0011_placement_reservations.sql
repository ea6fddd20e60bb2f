-- Placement by free resources, shared by every gateway on the database: agents report free disk
-- and the templates they hold; what gateways placed on an agent since its last heartbeat is
-- counted on its row (placed_*), added by the conditional UPDATE that claims the room and reset
-- to 0 by each heartbeat.
ALTER TABLE "agents" ADD COLUMN "disk_mib_free" integer;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "templates" jsonb DEFAULT '[]'::jsonb NOT NULL;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "placed_slots" integer DEFAULT 0 NOT NULL;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "placed_vcpus" integer DEFAULT 0 NOT NULL;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "placed_mem_mib" integer DEFAULT 0 NOT NULL;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "placed_disk_mib" integer DEFAULT 0 NOT NULL;