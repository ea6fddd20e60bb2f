-- Kept snapshots' usage in SQL beside the sandboxes' (docs/quotas-and-usage.md "Usage metering"),
-- so the operator views carry it as GET /v1/usage and `sandboxd usage` do.
-- One metered line, in usage_rollup's columns (migration 0003): both functions below answer them.
CREATE TYPE usage_line AS (
	tenant_id text,
	sandbox_id text,
	day date,
	running_seconds double precision,
	paused_seconds double precision,
	suspended_seconds double precision,
	cpu_core_hours double precision,
	ram_gb_hours double precision,
	disk_gb_hours double precision,
	snapshot_gb_months double precision
);
--> statement-breakpoint
-- snapshot_rollup: one line per snapshot and UTC day over the window [w_from, w_to), in
-- usage_rollup's columns (sandbox_id holds the snapshot's id). A snapshot is metered from ready_at
-- to deleted_at (a delete, its lost host's last heartbeat, or the pass that found its files gone;
-- still kept: until w_now), clipped to the window, cut at UTC midnights, weighted by size_bytes:
--   snapshot_gb_months = size_bytes / 2^30 * hours / 730
-- One that never became ready (failed, or still creating) has no ready_at and no line. Every other
-- column is 0: a snapshot runs nothing. p_tenant null: every tenant.
CREATE FUNCTION snapshot_rollup(p_tenant text, w_from timestamptz, w_to timestamptz, w_now timestamptz)
RETURNS SETOF usage_line
LANGUAGE sql STABLE AS $$
	SELECT c.tenant_id, c.id, d.d::date,
		0::float8, 0::float8, 0::float8, 0::float8, 0::float8, 0::float8,
		(c.gib * extract(epoch FROM least(c.e, d.d + interval '1 day') - greatest(c.s, d.d)) / 3600 / 730)::float8
	FROM (
		SELECT sn.tenant_id, sn.id, coalesce(sn.size_bytes, 0)::float8 / 1073741824 AS gib,
			(greatest(sn.ready_at, w_from) AT TIME ZONE 'UTC') AS s,
			(least(coalesce(sn.deleted_at, w_now), w_to) AT TIME ZONE 'UTC') AS e
		FROM snapshots sn
		WHERE (p_tenant IS NULL OR sn.tenant_id = p_tenant) AND sn.ready_at IS NOT NULL AND sn.state <> 'failed'
			AND sn.ready_at < w_to AND (sn.deleted_at IS NULL OR sn.deleted_at > w_from)
	) c
	CROSS JOIN LATERAL generate_series(date_trunc('day', c.s), c.e, interval '1 day') AS d(d)
	WHERE c.e > c.s AND least(c.e, d.d + interval '1 day') > greatest(c.s, d.d)
$$;
--> statement-breakpoint
-- Every metered line: the sandboxes' intervals and the kept snapshots. What GET /v1/usage,
-- `sandboxd usage` and the views below read.
CREATE FUNCTION usage_lines(p_tenant text, w_from timestamptz, w_to timestamptz, w_now timestamptz)
RETURNS SETOF usage_line
LANGUAGE sql STABLE AS $$
	SELECT * FROM usage_rollup(p_tenant, w_from, w_to, w_now)
	UNION ALL
	SELECT * FROM snapshot_rollup(p_tenant, w_from, w_to, w_now)
$$;
--> statement-breakpoint
-- The operator views of migration 0003, now over usage_lines: per tenant and UTC day ...
CREATE OR REPLACE VIEW usage_by_tenant_day AS
SELECT r.tenant_id, t.name AS tenant, r.day,
	sum(r.running_seconds) AS running_seconds, sum(r.paused_seconds) AS paused_seconds,
	sum(r.suspended_seconds) AS suspended_seconds, sum(r.cpu_core_hours) AS cpu_core_hours,
	sum(r.ram_gb_hours) AS ram_gb_hours, sum(r.disk_gb_hours) AS disk_gb_hours,
	sum(r.snapshot_gb_months) AS snapshot_gb_months
FROM usage_lines(NULL, '-infinity', 'infinity', now()) r
JOIN tenants t ON t.id = r.tenant_id
GROUP BY r.tenant_id, t.name, r.day;
--> statement-breakpoint
-- ... per tenant ...
CREATE OR REPLACE VIEW usage_by_tenant AS
SELECT r.tenant_id, t.name AS tenant,
	sum(r.running_seconds) AS running_seconds, sum(r.paused_seconds) AS paused_seconds,
	sum(r.suspended_seconds) AS suspended_seconds, sum(r.cpu_core_hours) AS cpu_core_hours,
	sum(r.ram_gb_hours) AS ram_gb_hours, sum(r.disk_gb_hours) AS disk_gb_hours,
	sum(r.snapshot_gb_months) AS snapshot_gb_months
FROM usage_lines(NULL, '-infinity', 'infinity', now()) r
JOIN tenants t ON t.id = r.tenant_id
GROUP BY r.tenant_id, t.name;
--> statement-breakpoint
-- ... and per sandbox, with how it ended (a sandbox that never ran has zeros), and per kept
-- snapshot: kind 'snapshot', its state, its error as end_detail, its deleted_at (the end of its
-- metering) as destroyed_at, and only snapshot_gb_months.
CREATE OR REPLACE VIEW usage_by_sandbox AS
SELECT s.tenant_id, s.id AS sandbox_id, s.kind, s.template_id, s.state, s.end_reason, s.end_detail,
	s.created_at, s.destroyed_at,
	coalesce(sum(r.running_seconds), 0) AS running_seconds, coalesce(sum(r.paused_seconds), 0) AS paused_seconds,
	coalesce(sum(r.suspended_seconds), 0) AS suspended_seconds,
	coalesce(sum(r.cpu_core_hours), 0) AS cpu_core_hours, coalesce(sum(r.ram_gb_hours), 0) AS ram_gb_hours,
	coalesce(sum(r.disk_gb_hours), 0) AS disk_gb_hours, coalesce(sum(r.snapshot_gb_months), 0) AS snapshot_gb_months
FROM sandboxes s
LEFT JOIN usage_rollup(NULL, '-infinity', 'infinity', now()) r ON r.sandbox_id = s.id
GROUP BY s.id
UNION ALL
SELECT sn.tenant_id, sn.id, 'snapshot', sn.template_id, sn.state, NULL, sn.error,
	sn.created_at, sn.deleted_at,
	0, 0, 0, 0, 0, 0, coalesce(sum(r.snapshot_gb_months), 0)
FROM snapshots sn
LEFT JOIN snapshot_rollup(NULL, '-infinity', 'infinity', now()) r ON r.sandbox_id = sn.id
GROUP BY sn.id;
