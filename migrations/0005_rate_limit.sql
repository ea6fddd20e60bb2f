CREATE TABLE "rate_windows" (
	"key" text PRIMARY KEY NOT NULL,
	"until_ms" double precision[] DEFAULT '{}' NOT NULL,
	"permits" integer[] DEFAULT '{}' NOT NULL
);

--> statement-breakpoint
-- Grants up to p_want of a key's requests at p_now (ms since the epoch): as many as fit under
-- p_limit beside the grants still counted (until_ms > p_now). A grant of one request is counted
-- for p_window_ms; a larger grant is a lease its gateway spends over the next p_hold_ms, so it is
-- counted for p_window_ms + p_hold_ms (no window of p_window_ms can then hold more than p_limit
-- requests, whenever inside its lease each one was spent). p_return requests of the grant that
-- ends at p_return_until expired unspent at the caller: they stop counting first. Nothing
-- granted: retry_ms says when the oldest grant stops counting. The row lock (FOR UPDATE) makes
-- concurrent callers for one key, from any gateway, decide one after another.
CREATE FUNCTION "sandboxd_rate_take"(
	p_key text, p_want integer, p_limit integer, p_now double precision,
	p_window_ms double precision, p_hold_ms double precision,
	p_return_until double precision, p_return integer
) RETURNS TABLE (granted integer, retry_ms double precision, until_ms double precision)
LANGUAGE plpgsql AS $$
DECLARE
	v_until double precision[];
	v_permits integer[];
	v_i integer;
	v_used integer;
	v_oldest double precision;
	v_grant integer;
	v_end double precision;
BEGIN
	INSERT INTO rate_windows (key) VALUES (p_key) ON CONFLICT (key) DO NOTHING;
	SELECT w.until_ms, w.permits INTO v_until, v_permits FROM rate_windows w WHERE w.key = p_key FOR UPDATE;
	IF p_return > 0 THEN
		v_i := array_position(v_until, p_return_until);
		IF v_i IS NOT NULL THEN
			v_permits[v_i] := greatest(v_permits[v_i] - p_return, 0);
		END IF;
	END IF;
	SELECT coalesce(array_agg(g.u), '{}'), coalesce(array_agg(g.n), '{}'), coalesce(sum(g.n), 0), min(g.u)
		INTO v_until, v_permits, v_used, v_oldest
		FROM unnest(v_until, v_permits) AS g(u, n) WHERE g.u > p_now AND g.n > 0;
	v_grant := greatest(0, least(p_want, p_limit - v_used));
	IF v_grant > 0 THEN
		v_end := p_now + p_window_ms + CASE WHEN v_grant > 1 THEN p_hold_ms ELSE 0 END;
		v_until := v_until || v_end;
		v_permits := v_permits || v_grant;
	END IF;
	UPDATE rate_windows w SET until_ms = v_until, permits = v_permits WHERE w.key = p_key;
	RETURN QUERY SELECT v_grant, CASE WHEN v_grant > 0 THEN 0::double precision ELSE v_oldest - p_now END, v_end;
END
$$;
