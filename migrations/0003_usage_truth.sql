ALTER TABLE "sandboxes" ADD COLUMN "end_detail" text;--> statement-breakpoint
-- Usage per tenant, sandbox and UTC day over the window [w_from, w_to): every usage interval is
-- clipped to the window (an open one runs until w_now), cut at UTC midnights with
-- generate_series, and weighted by its size. The one place these formulas live: the public
-- /v1/usage totals, the operator views below and `sandboxd usage` all read this function.
--   cpu_core_hours     = vcpus * hours                over running time
--   ram_gb_hours       = mem_mib / 1024 * hours       over running and paused time
--   disk_gb_hours      = disk_bytes / 2^30 * hours    over running and paused time
--   snapshot_gb_months = disk_bytes / 2^30 * hours / 730 over suspended time
-- p_tenant null: every tenant.
CREATE FUNCTION usage_rollup(p_tenant text, w_from timestamptz, w_to timestamptz, w_now timestamptz)
RETURNS TABLE (
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
)
LANGUAGE sql STABLE AS $$
	WITH clipped AS (
		SELECT u.tenant_id AS t, u.sandbox_id AS sb, u.state AS st,
			u.vcpus::float8 AS cpus, u.mem_mib::float8 / 1024 AS gib_ram, u.disk_bytes::float8 / 1073741824 AS gib_disk,
			(greatest(u.started_at, w_from) AT TIME ZONE 'UTC') AS s,
			(least(coalesce(u.ended_at, w_now), w_to) AT TIME ZONE 'UTC') AS e
		FROM usage_intervals u
		WHERE (p_tenant IS NULL OR u.tenant_id = p_tenant)
			AND u.started_at < w_to AND (u.ended_at IS NULL OR u.ended_at > w_from)
	), slices AS (
		SELECT c.t, c.sb, c.st, c.cpus, c.gib_ram, c.gib_disk, d.d::date AS dd,
			extract(epoch FROM least(c.e, d.d + interval '1 day') - greatest(c.s, d.d))::float8 AS secs
		FROM clipped c
		CROSS JOIN LATERAL generate_series(date_trunc('day', c.s), c.e, interval '1 day') AS d(d)
		WHERE c.e > c.s
	)
	SELECT x.t, x.sb, x.dd,
		coalesce(sum(x.secs) FILTER (WHERE x.st = 'running'), 0)::float8,
		coalesce(sum(x.secs) FILTER (WHERE x.st = 'paused'), 0)::float8,
		coalesce(sum(x.secs) FILTER (WHERE x.st = 'suspended'), 0)::float8,
		(coalesce(sum(x.cpus * x.secs) FILTER (WHERE x.st = 'running'), 0) / 3600)::float8,
		(coalesce(sum(x.gib_ram * x.secs) FILTER (WHERE x.st IN ('running', 'paused')), 0) / 3600)::float8,
		(coalesce(sum(x.gib_disk * x.secs) FILTER (WHERE x.st IN ('running', 'paused')), 0) / 3600)::float8,
		(coalesce(sum(x.gib_disk * x.secs) FILTER (WHERE x.st = 'suspended'), 0) / 3600 / 730)::float8
	FROM slices x
	WHERE x.secs > 0
	GROUP BY x.t, x.sb, x.dd
$$;
--> statement-breakpoint
-- Operator reports over all time (open intervals until now): per tenant and UTC day ...
CREATE VIEW usage_by_tenant_day AS
SELECT r.tenant_id, t.name AS tenant, r.day,
	sum(r.running_seconds) AS running_seconds, sum(r.paused_seconds) AS paused_seconds,
	sum(r.suspended_seconds) AS suspended_seconds, sum(r.cpu_core_hours) AS cpu_core_hours,
	sum(r.ram_gb_hours) AS ram_gb_hours, sum(r.disk_gb_hours) AS disk_gb_hours,
	sum(r.snapshot_gb_months) AS snapshot_gb_months
FROM usage_rollup(NULL, '-infinity', 'infinity', now()) r
JOIN tenants t ON t.id = r.tenant_id
GROUP BY r.tenant_id, t.name, r.day;
--> statement-breakpoint
-- ... per tenant ...
CREATE VIEW usage_by_tenant AS
SELECT r.tenant_id, t.name AS tenant,
	sum(r.running_seconds) AS running_seconds, sum(r.paused_seconds) AS paused_seconds,
	sum(r.suspended_seconds) AS suspended_seconds, sum(r.cpu_core_hours) AS cpu_core_hours,
	sum(r.ram_gb_hours) AS ram_gb_hours, sum(r.disk_gb_hours) AS disk_gb_hours,
	sum(r.snapshot_gb_months) AS snapshot_gb_months
FROM usage_rollup(NULL, '-infinity', 'infinity', now()) r
JOIN tenants t ON t.id = r.tenant_id
GROUP BY r.tenant_id, t.name;
--> statement-breakpoint
-- ... and per sandbox, with how it ended (a sandbox that never ran has zeros).
CREATE VIEW usage_by_sandbox AS
SELECT s.tenant_id, s.id AS sandbox_id, s.kind, s.template_id, s.state, s.end_reason, s.end_detail,
	s.created_at, s.destroyed_at,
	coalesce(sum(r.running_seconds), 0) AS running_seconds, coalesce(sum(r.paused_seconds), 0) AS paused_seconds,
	coalesce(sum(r.suspended_seconds), 0) AS suspended_seconds,
	coalesce(sum(r.cpu_core_hours), 0) AS cpu_core_hours, coalesce(sum(r.ram_gb_hours), 0) AS ram_gb_hours,
	coalesce(sum(r.disk_gb_hours), 0) AS disk_gb_hours, coalesce(sum(r.snapshot_gb_months), 0) AS snapshot_gb_months
FROM sandboxes s
LEFT JOIN usage_rollup(NULL, '-infinity', 'infinity', now()) r ON r.sandbox_id = s.id
GROUP BY s.id;
