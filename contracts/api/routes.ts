/**
 * Each route's contract apart from its handler: method, path, which API
 * serves it, its body/query schemas, its success response and its error statuses. openapi.yaml is
 * generated from this table (gateway/openapi.ts); the handlers in gateway/routes/ use the same
 * schemas to parse requests.
 */
import type { z } from "zod";
import { PtyQuery } from "./common.ts";
import * as F from "./files.ts";
import { HealthResponse } from "./health.ts";
import * as P from "./processes.ts";
import * as B from "./sandboxes-api.ts";
import * as A from "./sessions-api.ts";

/** The streamed form of both exec routes (gateway/routes/exec-sse.ts, docs/exec.md "Per-exec options and streamed exec"). */
/** Both terminal routes (gateway/routes/pty.ts, docs/processes-and-pty.md "Terminal"). */
const PTY_WS =
  "Binary messages carry terminal bytes both ways (a text message from the client is typed input " +
  'too, as its UTF-8 bytes); a text message `{"type":"resize","cols":N,"rows":M}` resizes the ' +
  "terminal. The shell is the image's (/bin/bash if present, else /bin/sh) as a login shell of the " +
  "image's user, in its own session; closing the WebSocket hangs it up and kills what is left of " +
  "its session. The WebSocket ends with 1000 when the shell exits. All checks (key, tenant, state, " +
  "relay slots) and the shell's start happen before the upgrade. A browser, which cannot set " +
  "`Authorization` on a WebSocket, may offer the key as subprotocols instead: `sandboxd` first, then " +
  "`sandboxd.key.<key>`; the server answers `sandboxd`.";
// 409: not running; 429 also: the tenant's relay slots are taken; 501/503: no agent terminals.
const PTY_ERRORS = [400, 403, 404, 409, 501, 503];

const EXEC_EVENTS =
  "With `Accept: text/event-stream` the exec streams Server-Sent Events while the command runs: " +
  '`event: stdout` / `event: stderr` with data `{"data": "<UTF-8 text>"}`, or `{"data_b64": "<base64>"}` ' +
  "for a chunk that is not valid UTF-8 (a character split across chunks is held back and sent whole), " +
  "in the order the command wrote them and not capped; then one `event: exit` whose data is this " +
  "route's JSON response with `stdout` and `stderr` empty. A failure after the first event is one " +
  '`event: error` with data `{"code", "message"}`, then the end of the stream. The status and headers ' +
  "come with the first output (or the end), so a refusal before any output is the JSON error below. " +
  "Closing the connection cancels the command (its process group is killed).";

/** The file API of both APIs (gateway/routes/files.ts, docs/files.md "The file API"). */
function fileRoutes(base: string, api: "sessions" | "sandboxes"): RouteContract[] {
  const path = `${base}/{id}/files`;
  const what = api === "sessions" ? "session" : "sandbox";
  return [
    {
      method: "put",
      path,
      api,
      summary: `Upload a file into the ${what} (raw body, streamed; parent directories created)`,
      query: F.FilesQuery,
      rawBody: "application/octet-stream",
      response: F.FileWritten,
      status: 200,
      // 400: a relative path, or one the guest refuses (a directory, no permission, its disk
      // full); 413: over MAX_FILE_TRANSFER_BYTES.
      errors: [400, 403, 404, 409, 410, 413],
    },
    {
      method: "get",
      path,
      api,
      summary: `Download a file from the ${what} (raw bytes, streamed), or with \`list=true\` list a directory`,
      query: F.FilesQuery,
      response: F.FileList,
      rawResponse: "application/octet-stream",
      status: 200,
      // 400: a directory without list=true, a relative path; 404: no such path.
      errors: [400, 403, 404, 409, 410],
    },
    {
      method: "delete",
      path,
      api,
      summary: `Delete a file, symlink or empty directory in the ${what}`,
      query: F.FilesQuery,
      response: F.FileDeleted,
      status: 200,
      // 409: a directory that is not empty.
      errors: [400, 403, 404, 409, 410],
    },
  ];
}

export interface RouteContract {
  method: "get" | "post" | "put" | "delete";
  /** OpenAPI-style path (`{id}`). */
  path: string;
  /** Which key API the handler serves; "both" = the same handler; "none" = no auth. */
  api: "sessions" | "sandboxes" | "both" | "none";
  summary: string;
  /** Longer prose for the operation, where the summary cannot say how it is used. */
  description?: string;
  body?: z.ZodType;
  /** Raw (non-JSON) body content type. */
  rawBody?: string;
  query?: z.ZodObject;
  response?: z.ZodType;
  /** Non-JSON response content type. */
  rawResponse?: string;
  /** The success response may also be `text/event-stream` (asked for with `Accept`): its events. */
  eventStream?: string;
  status: number;
  /**
   * The sandboxes API form of a path both APIs share ("both"), when it differs from the sessions API
   * one above: its own body, and its own status when that differs too (e.g. DELETE 200 vs 204).
   */
  sandboxesForm?: { status: number; response?: z.ZodType };
  /**
   * Error statuses the route can return besides 401/429 (which every authed route can) and 500
   * (which every route can: an unexpected failure, envelope code `internal`).
   */
  errors: number[];
}

/**
 * The background-process routes of one API (docs/processes-and-pty.md "Background processes"); the same
 * handlers serve both (gateway/routes/processes.ts). 409: a sandbox that is not running (a
 * user-suspended one), 32 processes running already, or stdin to one that has ended or is closed.
 */
function processRoutes(base: string, api: "sessions" | "sandboxes"): RouteContract[] {
  const one = `${base}/{id}/processes/{pid}`;
  return [
    {
      method: "post",
      path: `${base}/{id}/processes`,
      api,
      summary: "Start a background process (runs beside exec)",
      body: P.StartProcessRequest,
      response: P.ProcessInfo,
      status: 201,
      errors: [400, 403, 404, 409, 413],
    },
    {
      method: "get",
      path: `${base}/{id}/processes`,
      api,
      summary: "List background processes",
      response: P.ProcessList,
      status: 200,
      errors: [403, 404, 409],
    },
    {
      method: "get",
      path: `${one}/logs`,
      api,
      summary: "A background process's output so far (or followed)",
      response: P.ProcessLogsResponse,
      eventStream: P.PROCESS_LOG_EVENTS,
      status: 200,
      errors: [403, 404, 409],
    },
    {
      method: "post",
      path: `${one}/stdin`,
      api,
      summary: "Write to a background process's standard input (JSON or raw bytes)",
      body: P.ProcessStdinRequest,
      rawBody: "application/octet-stream",
      query: P.ProcessStdinQuery,
      response: P.ProcessStdinResponse,
      status: 200,
      errors: [400, 403, 404, 409, 413],
    },
    {
      method: "delete",
      path: one,
      api,
      summary: "Kill a background process's process group",
      response: P.ProcessInfo,
      status: 200,
      errors: [403, 404, 409],
    },
  ];
}

export const ROUTES: RouteContract[] = [
  {
    method: "get",
    path: "/v1/health",
    api: "none",
    summary: "Health (both forms in one object)",
    response: HealthResponse,
    status: 200,
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
    summary: "List live sessions",
    response: A.SessionList,
    status: 200,
    errors: [403],
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
  {
    method: "get",
    path: "/v1/images",
    api: "sandboxes",
    summary: "Template catalog",
    response: B.CatalogList,
    status: 200,
    errors: [403],
  },
  {
    method: "post",
    path: "/v1/templates/{id}/expect",
    api: "sandboxes",
    summary: "Declare the next session width (Pro)",
    body: B.ExpectRequest,
    response: B.ExpectResponse,
    status: 200,
    errors: [400, 403, 404],
  },
  {
    method: "post",
    path: "/v1/templates/{id}/release",
    api: "sandboxes",
    summary: "End the session; capacity relaxes now (Pro)",
    response: B.ReleaseResponse,
    status: 200,
    errors: [403, 404],
  },
  {
    method: "post",
    path: "/v1/sandboxes",
    api: "sandboxes",
    summary: "Create a sandbox",
    body: B.CreateSandboxRequest,
    response: B.CreateSandboxResponse,
    status: 201,
    errors: [400, 403, 404, 409, 503],
  },
  {
    method: "get",
    path: "/v1/sandboxes",
    api: "sandboxes",
    summary: "List the tenant's sandboxes",
    response: B.SandboxList,
    status: 200,
    errors: [403],
  },
  {
    method: "get",
    path: "/v1/sandboxes/{id}",
    api: "sandboxes",
    summary: "Sandbox info",
    response: B.SandboxInfo,
    status: 200,
    errors: [403, 404],
  },
  {
    method: "post",
    path: "/v1/sandboxes/{id}/exec",
    api: "sandboxes",
    summary: "Exec in a sandbox",
    body: B.ExecRequestB,
    response: B.ExecResponseB,
    eventStream: EXEC_EVENTS,
    status: 200,
    errors: [400, 403, 404, 409, 413],
  },
  {
    method: "post",
    path: "/v1/sandboxes/{id}/fork",
    api: "sandboxes",
    summary: "Fork into copy-on-write children",
    body: B.ForkRequest,
    response: B.ForkResponse,
    status: 200,
    errors: [400, 403, 404, 409, 503],
  },
  {
    method: "post",
    path: "/v1/sandboxes/{id}/connect-url",
    api: "sandboxes",
    summary: "Mint a scoped connect URL (Pro)",
    body: B.ConnectUrlRequest,
    response: B.ConnectUrlResponse,
    status: 200,
    errors: [400, 403, 404, 409],
  },
  {
    method: "get",
    path: "/v1/sandboxes/{id}/connect",
    api: "sandboxes",
    summary: "WebSocket tunnel to a guest port (Bearer key or `t` token)",
    query: B.ConnectQuery,
    status: 101,
    // 503/501: the sandbox's agent does not answer / offers no tunnels; 502 port_unreachable:
    // nothing accepts connections on the port inside the sandbox (all before the upgrade).
    errors: [400, 403, 404, 409, 501, 502, 503],
  },
  {
    method: "get",
    path: "/v1/sandboxes/{id}/pty",
    api: "sandboxes",
    summary: "Interactive terminal over a WebSocket",
    description: PTY_WS,
    query: PtyQuery,
    status: 101,
    errors: PTY_ERRORS,
  },
  {
    method: "post",
    path: "/v1/sandboxes/{id}/suspend",
    api: "sandboxes",
    summary: "Snapshot to disk; metering stops",
    response: B.StateResponse,
    status: 200,
    // 507: the host's disk has no room for the RAM image; the sandbox keeps running.
    errors: [403, 404, 409, 507],
  },
  {
    method: "post",
    path: "/v1/sandboxes/{id}/resume",
    api: "sandboxes",
    summary: "Restore from disk",
    response: B.StateResponse,
    status: 200,
    errors: [403, 404, 409, 503],
  },
  {
    method: "delete",
    path: "/v1/sandboxes/{id}",
    api: "sandboxes",
    summary: "Destroy a sandbox",
    response: B.DeleteSandboxResponse,
    status: 200,
    errors: [403, 404],
  },
  {
    method: "get",
    path: "/v1/usage",
    api: "sandboxes",
    summary: "Tenant usage over a window",
    query: B.UsageQuery,
    response: B.UsageResponse,
    status: 200,
    errors: [400, 403],
  },
  ...processRoutes("/v1/sessions", "sessions"),
  ...processRoutes("/v1/sandboxes", "sandboxes"),
  ...fileRoutes("/v1/sandboxes", "sandboxes"),
  ...fileRoutes("/v1/sessions", "sessions"),
];
