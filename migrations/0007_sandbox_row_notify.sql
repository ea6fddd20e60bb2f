-- Every change to a sandbox or session row is announced on the channel `sandboxes_changed` with
-- the row's id as payload, after its transaction commits (NOTIFY's own semantics): each gateway
-- LISTENs and drops its in-memory copy of that row (gateway/core/row-cache.ts). A trigger, not
-- the gateway's code, so that no write to the table can skip it: the reaper's, the agents'
-- reports, reconciliation, another gateway version, an operator's SQL. Payloads are ids (under
-- 64 bytes), far under NOTIFY's 8000-byte limit; identical notifications of one transaction are
-- delivered once.
CREATE FUNCTION "sandboxd_sandbox_changed"() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
	IF TG_OP = 'DELETE' THEN
		PERFORM pg_notify('sandboxes_changed', OLD.id);
	ELSE
		PERFORM pg_notify('sandboxes_changed', NEW.id);
		-- An update that changed the id (none does) also invalidates the old one.
		IF TG_OP = 'UPDATE' AND OLD.id <> NEW.id THEN
			PERFORM pg_notify('sandboxes_changed', OLD.id);
		END IF;
	END IF;
	RETURN NULL;
END
$$;
--> statement-breakpoint
CREATE TRIGGER "sandboxes_changed_notify" AFTER INSERT OR UPDATE OR DELETE ON "sandboxes"
	FOR EACH ROW EXECUTE FUNCTION "sandboxd_sandbox_changed"();
