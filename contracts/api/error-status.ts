/**
 * The HTTP status of each public error code (docs/api.md "Rules every route shares"): the gateway
 * (gateway/errors.ts) and the edge (edge/) answer every `{code, message}` envelope with the status
 * this table gives its code. Type-only imports: an edge isolate bundles it as plain data.
 */
import type { ContentfulStatusCode } from "hono/utils/http-status";
import type { PublicErrorCode } from "../errors.ts";

export const STATUS_OF_CODE: Readonly<Record<PublicErrorCode, ContentfulStatusCode>> = {
  bad_request: 400,
  unauthorized: 401,
  forbidden: 403,
  demo_tier_limit: 403,
  not_found: 404,
  gone: 410, // sessions API: the session's VM has been reclaimed (docs/api.md#rules-every-route-shares)
  busy: 409,
  template_in_use: 409,
  template_not_ready: 409, // sessions API: spawning from a template still building (docs/templates.md#rules-of-templates)
  conflict: 409, // duplicate template id; a state that does not allow the action
  port_not_exposed: 409,
  size_unavailable: 400, // a size the template or snapshot was not frozen with; details.sizes lists its own
  invalid_file: 400, // the guest refused a file of `files`; the message says which and why
  // The gateway reached the sandbox, whose guest refused the connect: an upstream failure.
  port_unreachable: 502,
  payload_too_large: 413,
  // The edge (docs/edge.md): the key names a region this edge has no gateways for. 421 Misdirected
  // Request: this address cannot serve the key; another edge (or the region's own address) can.
  unknown_region: 421,
  rate_limited: 429,
  quota_exceeded: 429,
  at_capacity: 503,
  insufficient_storage: 507, // the host's disk lacks room for this write; retry once space returns
  agent_unavailable: 503, // the sandbox's host agent does not answer; retry with backoff
  db_unavailable: 503, // the gateway's database does not answer; retry after Retry-After
  // The edge (docs/edge.md): no gateway of the request's region answered; retry with backoff. 503
  // as agent_unavailable: the SDKs retry it (they retry 429 and 503), and the call was not served.
  gateway_unavailable: 503,
  not_implemented: 501, // a feature this deployment's agent does not offer
  spawn_failed: 503,
  bringup_timeout: 504,
  internal: 500,
};
