-- Every change to an API key's row is announced on the channel `api_keys_changed` with the key's
-- hash as payload (what each gateway's key cache is keyed by), after its transaction commits
-- (NOTIFY's own semantics): each gateway LISTENs and drops its verified copy of that key
-- (gateway/auth/key-cache.ts), so a revocation by any process (another gateway, `sandboxd key
-- revoke` over PostgreSQL, an operator's SQL) applies at once instead of when a TTL ends. A
-- trigger, not the gateway's code, so that no write to the table can skip it. Payloads are 64 hex
-- characters, far under NOTIFY's 8000-byte limit.
CREATE FUNCTION "sandboxd_api_key_changed"() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
	IF TG_OP = 'DELETE' THEN
		PERFORM pg_notify('api_keys_changed', OLD.hash);
	ELSE
		PERFORM pg_notify('api_keys_changed', NEW.hash);
		-- An update that changed the hash (none does) also drops the old one.
		IF TG_OP = 'UPDATE' AND OLD.hash <> NEW.hash THEN
			PERFORM pg_notify('api_keys_changed', OLD.hash);
		END IF;
	END IF;
	RETURN NULL;
END
$$;
--> statement-breakpoint
CREATE TRIGGER "api_keys_changed_notify" AFTER INSERT OR UPDATE OR DELETE ON "api_keys"
	FOR EACH ROW EXECUTE FUNCTION "sandboxd_api_key_changed"();
