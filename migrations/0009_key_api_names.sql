-- The two public APIs are named by what they serve, the sessions API (live and scale keys:
-- `/v1/exec`, `/v1/sessions`, uploaded templates) and the sandboxes API (demo, pro and enterprise
-- keys: `/v1/sandboxes`, the catalog, baking); the rows that record which one created them say so
-- in the same words instead of the letters "a" and "b". A rename and an update in one transaction,
-- so no reader sees a mix; the index on (tenant_id, api, state) follows the renamed column.
ALTER TABLE "sandboxes" RENAME COLUMN "family" TO "api";--> statement-breakpoint
UPDATE "sandboxes" SET "api" = CASE "api" WHEN 'a' THEN 'sessions' WHEN 'b' THEN 'sandboxes' ELSE "api" END;--> statement-breakpoint
ALTER TABLE "templates" RENAME COLUMN "family" TO "api";--> statement-breakpoint
UPDATE "templates" SET "api" = CASE "api" WHEN 'a' THEN 'sessions' WHEN 'b' THEN 'sandboxes' ELSE "api" END;
