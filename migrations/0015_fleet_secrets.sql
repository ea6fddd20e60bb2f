-- Fingerprints of the secrets the gateways sharing this database must hold alike
-- (docs/operations.md "Secrets across a fleet"): a gateway with other secrets refuses to start.
CREATE TABLE "fleet_secrets" (
	"name" text PRIMARY KEY NOT NULL,
	"fingerprint" text NOT NULL,
	"set_at" timestamp with time zone DEFAULT now() NOT NULL
);
