/**
 * Enrollment: how an agent gets its own key. The operator makes a one-time token
 * (`sandboxd agent-token create`); the agent sends it once to `POST /internal/agents/enroll` with
 * the id it wants and gets back its id and a random key, which it keeps in its data dir (0600)
 * and signs its heartbeats with; the gateway signs its calls to that agent with the same key
 * (token.ts). Later starts reuse the stored key. The gateway side is
 * gateway/agents/enrollment.ts, the agent side agent/api/enroll.ts.
 */
import { z } from "zod";
import { REGION_NAME_PATTERN } from "../api/api-key.ts";

/** Outside the public /v1 API, beside the heartbeat. */
export const ENROLL_PATH = "/internal/agents/enroll";

export const AgentId = z.string().regex(/^[A-Za-z0-9._-]{1,64}$/);

/** A region's name (a tenant's home, an agent's place): contracts/api/api-key.ts `REGION_NAME_PATTERN`. */
export const RegionName = z.string().regex(REGION_NAME_PATTERN);

/**
 * The region of `up`, and of a `gateway` or an enrollment token given no `--region`
 * (docs/regions.md "Rules of regions").
 */
export const DEFAULT_REGION = "local";

/** `sbxe_<token id>_<secret>`: the id finds the stored hash, the secret is checked against it. */
export const ENROLLMENT_TOKEN_RE = /^sbxe_([a-f0-9]{16})_([A-Za-z0-9_-]{43})$/;

export const EnrollRequest = z.object({
  token: z.string().max(200),
  id: AgentId,
});
export type EnrollRequest = z.infer<typeof EnrollRequest>;

export const EnrollResponse = z.object({
  id: AgentId,
  /** 64 hex characters: the agent's HS256 key. */
  key: z.string().regex(/^[a-f0-9]{64}$/),
});
export type EnrollResponse = z.infer<typeof EnrollResponse>;
