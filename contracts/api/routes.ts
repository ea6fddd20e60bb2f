/**
 * Each route's contract apart from its handler: method, path, which API
 * serves it, its body/query schemas, its success response and its error statuses. openapi.yaml is
 * generated from this table (gateway/openapi.ts); the handlers in gateway/routes/ use the same
 * schemas to parse requests.
 *
 * The table by API: the sessions API's routes are routes-sessions.ts's, the sandboxes API's
 * routes-sandboxes.ts's; the routes without a key and the template paths both keys reach are
 * here, the file and process routes of each API and the shape of a contract routes-common.ts's.
 * `ROUTES` keeps the one order openapi.yaml lists them in.
 */
import { HealthResponse } from "./health.ts";
import { fileRoutes, processRoutes, type RouteContract } from "./routes-common.ts";
import { SANDBOXES_ROUTES } from "./routes-sandboxes.ts";
import { SESSIONS_ROUTES } from "./routes-sessions.ts";
import * as B from "./sandboxes-api.ts";
import * as A from "./sessions-api.ts";

export type { RouteContract } from "./routes-common.ts";

export const ROUTES: RouteContract[] = [
  {
    method: "get",
    path: "/v1/health",
    api: "none",
    summary: "Health (both forms in one object)",
    response: HealthResponse,
    status: 200,
    alsoAnswers: {
      status: 503,
      description: "Starting: no agent of the gateway's region has been live yet (`status: starting`)",
      response: HealthResponse,
    },
    errors: [],
  },
  {
    method: "get",
    path: "/v1/openapi.yaml",
    api: "none",
    summary: "This API description (public documentation: no key)",
    rawResponse: "application/yaml",
    status: 200,
    errors: [],
  },
  {
    method: "get",
    path: "/v1/metrics",
    api: "both",
    summary: "Prometheus metrics for the caller's tenant",
    rawResponse: "text/plain; version=0.0.4",
    status: 200,
    errors: [],
  },
  // The sessions API
  ...SESSIONS_ROUTES,
  // Template paths both APIs serve, each with its own form
  {
    method: "post",
    path: "/v1/templates",
    api: "both",
    summary:
      "Sessions API (scale key): register from an uploaded image (octet-stream, query id...). Sandboxes API (Pro): bake from an OCI image (JSON)",
    rawBody: "application/octet-stream",
    query: A.RegisterTemplateQuery,
    body: B.BakeTemplateRequest,
    response: A.RegisterTemplateResponse,
    status: 202,
    sandboxesForm: { status: 202, response: B.TemplateB },
    // 507: the upload does not fit on the disk with its reserve (checked before and while writing).
    errors: [400, 403, 409, 413, 507],
  },
  {
    method: "get",
    path: "/v1/templates",
    api: "both",
    summary: "Sessions API: map id -> {ready}. Sandboxes API: alias of /v1/images (array)",
    response: A.TemplateListA,
    status: 200,
    sandboxesForm: { status: 200, response: B.CatalogList },
    errors: [],
  },
  {
    method: "get",
    path: "/v1/templates/{id}",
    api: "both",
    summary: "Sessions API: build status. Sandboxes API: bake phase and readiness",
    response: A.TemplateA,
    status: 200,
    sandboxesForm: { status: 200, response: B.TemplateB },
    errors: [404],
  },
  {
    method: "delete",
    path: "/v1/templates/{id}",
    api: "both",
    summary: "Delete an own template (A: 204, scale key; B: 200 {deleted,id})",
    status: 204,
    sandboxesForm: { status: 200, response: B.DeleteTemplateResponseB },
    errors: [403, 404, 409],
  },
  // The sandboxes API
  ...SANDBOXES_ROUTES,
  ...processRoutes("/v1/sessions", "sessions"),
  ...processRoutes("/v1/sandboxes", "sandboxes"),
  ...fileRoutes("/v1/sandboxes", "sandboxes"),
  ...fileRoutes("/v1/sessions", "sessions"),
];
