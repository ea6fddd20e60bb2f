-- Which gateway holds each dial-out agent's link (docs/regions.md "Gateways behind one address"):
-- gateways without a link relay that agent's calls to one with a fresh row.
CREATE TABLE "dial_links" (
	"agent_id" text NOT NULL,
	"peer_url" text NOT NULL,
	"seen_at" timestamp with time zone NOT NULL,
	CONSTRAINT "dial_links_agent_id_peer_url_pk" PRIMARY KEY("agent_id","peer_url")
);
--> statement-breakpoint
ALTER TABLE "dial_links" ADD CONSTRAINT "dial_links_agent_id_agents_id_fk" FOREIGN KEY ("agent_id") REFERENCES "public"."agents"("id") ON DELETE cascade ON UPDATE no action;