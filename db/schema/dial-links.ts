import { pgTable, primaryKey, text, timestamp } from "drizzle-orm/pg-core";
import { agents } from "./agents.ts";

/**
 * Which gateway holds a dial-out agent's link (docs/regions.md "Gateways behind one address"):
 * a gateway that accepts an agent's link writes its own peer URL here and refreshes `seenAt`
 * while the link lives; a gateway without a link to that agent relays its calls to one with a
 * fresh row. A row is deleted when its link closes; one left by a gateway that died goes stale
 * (its `seenAt` stops) and is ignored, then replaced by the agent's next link.
 */
export const dialLinks = pgTable(
  "dial_links",
  {
    agentId: text("agent_id")
      .notNull()
      .references(() => agents.id, { onDelete: "cascade" }),
    /** The base URL other gateways reach the linked gateway at (`--peer-url`). */
    peerUrl: text("peer_url").notNull(),
    seenAt: timestamp("seen_at", { withTimezone: true, mode: "date" }).notNull(),
  },
  (t) => [primaryKey({ columns: [t.agentId, t.peerUrl] })],
);
