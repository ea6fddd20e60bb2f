/**
 * What the route tables of both APIs share (routes.ts, routes-sessions.ts, routes-sandboxes.ts):
 * the shape of a route's contract, the prose of the terminal and streamed-exec routes, and the
 * file and background-process routes each API has under its own prefix.
 */
import type { z } from "zod";
import * as F from "./files.ts";
import * as P from "./processes.ts";

/** Both terminal routes (gateway/routes/pty.ts, docs/processes-and-pty.md "Terminal"). */
export const PTY_WS =
  "Binary messages carry terminal bytes both ways (a text message from the client is typed input " +
  'too, as its UTF-8 bytes); a text message `{"type":"resize","cols":N,"rows":M}` resizes the ' +
  "terminal. The shell is the image's (/bin/bash if present, else /bin/sh) as a login shell of the " +
  "image's user, in its own session; closing the WebSocket hangs it up and kills what is left of " +
  "its session. The WebSocket ends with 1000 when the shell exits, and with 1008 (reason `the API key " +
  "was revoked`) when the key that opened it is revoked. All checks (key, tenant, state, " +
  "relay slots) and the shell's start happen before the upgrade. A browser, which cannot set " +
  "`Authorization` on a WebSocket, may offer the key as subprotocols instead: `sandboxd` first, then " +
  "`sandboxd.key.<key>`; the server answers `sandboxd`.";
// 409: not running; 429 also: the tenant's relay slots are taken; 501/503: no agent terminals.
export const PTY_ERRORS = [400, 403, 404, 409, 501, 503];

/** The streamed form of both exec routes (gateway/routes/exec-sse.ts, docs/exec.md "Per-exec options and streamed exec"). */
export const EXEC_EVENTS =
  "With `Accept: text/event-stream` the exec streams Server-Sent Events while the command runs: " +
  '`event: stdout` / `event: stderr` with data `{"data": "<UTF-8 text>"}`, or `{"data_b64": "<base64>"}` ' +
  "for a chunk that is not valid UTF-8 (a character split across chunks is held back and sent whole), " +
  "in the order the command wrote them and not capped; then one `event: exit` whose data is this " +
  "route's JSON response with `stdout` and `stderr` empty. A failure after the first event is one " +
  '`event: error` with data `{"code", "message"}`, then the end of the stream. The status and headers ' +
  "come with the first output (or the end), so a refusal before any output is the JSON error below. " +
  "Closing the connection cancels the command (its process group is killed); so does revoking the key " +
  "that opened the stream, which then ends with an `event: error` of code `unauthorized`.";

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
  /** A second answer with a body of its own besides the success (health's 503 `starting`). */
  alsoAnswers?: { status: number; description: string; response: z.ZodType };
  /**
   * Error statuses the route can return besides 401/429 (which every authed route can) and 500
   * (which every route can: an unexpected failure, envelope code `internal`).
   */
  errors: number[];
}

/** The file API of both APIs (gateway/routes/files.ts, docs/files.md "The file API"). */
export function fileRoutes(base: string, api: "sessions" | "sandboxes"): RouteContract[] {
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

/**
 * The background-process routes of one API (docs/processes-and-pty.md "Background processes"); the same
 * handlers serve both (gateway/routes/processes.ts). 409: a sandbox that is not running (a
 * user-suspended one), 32 processes running already, or stdin to one that has ended or is closed.
 */
export function processRoutes(base: string, api: "sessions" | "sandboxes"): RouteContract[] {
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
