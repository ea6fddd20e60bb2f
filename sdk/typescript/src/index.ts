/**
 * @sandboxd/sdk: the TypeScript client of sandboxd, for Bun, Node >= 20 and Deno (README.md).
 * Runtime code uses only what all three give (fetch, streams, WebCrypto, node:net/node:tls for
 * the terminal's WebSocket); the types come from the service's contracts.
 */
export {
  type BakeOptions,
  type CreateSandboxOptions,
  Sandboxd,
  type SandboxdOptions,
  Sandboxes,
  Sessions,
  type SnapshotListOptions,
  Snapshots,
  Templates,
  type UploadOptions,
  type WaitOptions,
} from "./client.ts";
export { type ClientErrorCode, type ErrorCode, SandboxdError } from "./errors.ts";
export type { Body, Fetch, RetryOptions } from "./http.ts";
export { Files, Processes } from "./resources.ts";
export { type Command, type ConnectUrlOptions, Sandbox, Session, type SessionCode } from "./sandbox.ts";
export { Terminal, type TerminalExit, type TerminalOptions } from "./terminal.ts";
export type * from "./types.ts";
