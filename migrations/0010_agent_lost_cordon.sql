-- Losing a host and taking one out of placement (gateway/core/host-loss.ts, docs/fleet.md): `lost_at`
-- is set by the one gateway that found the agent silent past the lost bound (a conditional UPDATE,
-- so several gateways on one database act once), cleared by its next heartbeat; `cordoned_at` keeps
-- new VMs off the agent (`sandboxd fleet cordon|drain`). Sandboxes of a lost agent end with
-- end_reason `host_lost`, a new value of the text column (no constraint to change).
ALTER TABLE "agents" ADD COLUMN "lost_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "agents" ADD COLUMN "cordoned_at" timestamp with time zone;
