/**
 * The sessions API's routes, in openapi.yaml's order (routes.ts lists them after health, the API
 * description and metrics); POST /v1/sessions also answers a sandboxes API key, as an alias.
 */
import { PtyQuery } from "./common.ts";
import { EXEC_EVENTS, PTY_ERRORS, PTY_WS, type RouteContract } from "./routes-common.ts";
import * as B from "./sandboxes-api.ts";
import * as A from "./sessions-api.ts";

export const SESSIONS_ROUTES: RouteContract[] = [
  {
    method: "post",
    path: "/v1/exec",
    api: "sessions",
    summary:
      "One-shot exec in a throwaway VM; while it runs it counts toward the live-session cap, and it is metered",
    body: A.ExecRequestA,
    response: A.ExecResultA,
    status: 200,
    errors: [400, 403, 404, 409, 413, 503, 504],
  },
  {
    method: "post",
    path: "/v1/exec/batch",
    api: "sessions",
    summary:
      "Batch exec, one VM per execution; each counts toward the live-session cap (all are reserved at once)",
    body: A.BatchExecRequest,
    response: A.BatchExecResponse,
    status: 200,
    errors: [400, 403, 404, 409, 413, 503, 504],
  },
  {
    method: "post",
    path: "/v1/sessions",
    api: "both",
    summary: "Sessions API: create a session. Sandboxes API: alias of POST /v1/sandboxes",
    body: A.CreateSessionRequest,
    response: A.CreateSessionResponse,
    status: 201,
    sandboxesForm: { status: 201, response: B.CreateSandboxResponse },
    errors: [400, 403, 404, 409, 503, 504],
  },
  {
    method: "get",
    path: "/v1/sessions",
    api: "sessions",
    summary: "List live sessions, paged (oldest first)",
    query: A.SessionListQuery,
    response: A.SessionList,
    status: 200,
    errors: [400, 403],
  },
  {
    method: "get",
    path: "/v1/sessions/{id}",
    api: "sessions",
    summary: "Session status",
    response: A.SessionStatus,
    status: 200,
    errors: [403, 404, 410],
  },
  {
    method: "post",
    path: "/v1/sessions/{id}/exec",
    api: "sessions",
    summary: "Exec in a session",
    body: A.SessionExecRequest,
    response: A.ExecResultA,
    eventStream: EXEC_EVENTS,
    status: 200,
    errors: [400, 403, 404, 409, 410, 413],
  },
  {
    method: "get",
    path: "/v1/sessions/{id}/pty",
    api: "sessions",
    summary: "Interactive terminal over a WebSocket",
    description: PTY_WS,
    query: PtyQuery,
    status: 101,
    errors: PTY_ERRORS,
  },
  {
    method: "post",
    path: "/v1/sessions/{id}/fork",
    api: "sessions",
    summary: "Fork a session into one child",
    response: A.ForkSessionResponse,
    status: 201,
    errors: [403, 404, 409, 410, 503],
  },
  {
    method: "delete",
    path: "/v1/sessions/{id}",
    api: "sessions",
    summary: "Delete a session",
    query: A.DeleteSessionQuery,
    status: 204,
    errors: [403, 404, 410],
  },
];
