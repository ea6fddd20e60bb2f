/** The options and results of GuestClient's ops (client.ts). */

export interface GuestClientOptions {
  /** Bound on the HELLO round trip. 10 s: a restored VM answers its first frame in ~150 ms under
   * TCG (~1 ms on KVM); a guest silent for 10 s on a loaded host is treated as dead. */
  helloTimeoutMs?: number;
  /** Bound on every non-exec op. 60 s: the slowest is a 1 MiB WRITE_FILE or a SYNC of a dirty
   * disk under TCG, seconds at worst; beyond a minute the guest is stuck, not slow. */
  requestTimeoutMs?: number;
  /** Added to an exec's own `timeoutMs` before the client gives up on it: the guest enforces the
   * timeout itself (SIGKILL of the group, 20 ms drain, one frame back), so the client only waits
   * that much longer for the answer to travel. 10 s covers a loaded TCG guest. The same grace
   * bounds the wait for the answer after a CANCEL. */
  execGraceMs?: number;
  /** Diagnostics lines the guest sends as LOG frames. */
  onLog?: (line: string) => void;
  /** How long bytes may wait towards a guest that reads none of them (default SEND_STALL_MS). */
  sendStallMs?: number;
  /** How long a tunnel the guest opened may carry no byte either way (default GUEST_TUNNEL_IDLE_MS). */
  guestTunnelIdleMs?: number;
  /** How long a CLOSE we sent may wait for the guest's (default CLOSE_ANSWER_MS, tunnel.ts). */
  closeAnswerMs?: number;
}

/** `GuestClient.openPty`: the terminal's size, and who runs which shell where. */
export interface PtyOptions {
  cols: number;
  rows: number;
  argv?: string[];
  /** `NAME=value` entries; the guest adds login defaults for the names missing. */
  env?: string[];
  cwd?: string;
  uid?: number;
  gid?: number;
}

export interface HelloInfo {
  protoVersion: number;
  agentVersion: string;
  bootId: string;
  uptimeMs: number;
}

export interface ExecOptions {
  argv: string[];
  /** The whole environment; `argv[0]` is searched in its PATH. */
  env?: Record<string, string> | string[];
  cwd?: string;
  uid?: number;
  gid?: number;
  /** Guest-side timeout: the whole process group is killed (`timedOut`, `signal` 9). */
  timeoutMs?: number;
  /** Inline stdin (sent with the request), or chunks streamed as STDIN frames then EOF. */
  stdin?: string | Uint8Array | AsyncIterable<Uint8Array | string>;
  /** Per-stream capture cap in bytes (guest default 1 MiB). Streamed output is capped here too. */
  maxOutput?: number;
  /** Bytes mixed into the guest's entropy pool before the command runs. */
  seed?: Uint8Array;
  /** Given either callback, output is streamed as it is produced (and still collected). */
  onStdout?: (chunk: Buffer) => void;
  /** `false`: streamed output goes to the callbacks only, none is kept for the result. */
  collect?: boolean;
  onStderr?: (chunk: Buffer) => void;
  /** Aborting sends CANCEL: the group is killed and the result comes back with `signal` 9. */
  signal?: AbortSignal;
  /**
   * Called once the guest has forked the command (a STARTED frame): its cwd and argv were
   * accepted, before any output. A refusal (a bad cwd) rejects the exec without calling it.
   * `pid`: the command's pid in the guest; undefined from an older guest agent (one frozen in a
   * template) whose STARTED frame is empty (docs/guest-protocol.md "Streams").
   */
  onStarted?: (pid: number | undefined) => void;
}

export interface ExecResult {
  exitCode: number | null;
  signal: number | null;
  timedOut: boolean;
  stdout: Buffer;
  stderr: Buffer;
  stdoutTruncated: boolean;
  stderrTruncated: boolean;
  durationUs: number;
  pid: number;
  /** True when a `seed` was given and the guest mixed it in and reseeded. */
  seedAck: boolean;
}

export interface ReadFileResult {
  data: Buffer;
  /** Size of the file (bytes read, for files without a size such as procfs). */
  size: number;
  truncated: boolean;
}

export interface FileOptions {
  /** Base for a relative path (default "/"). */
  cwd?: string;
  /** Whom the guest does the op as (its filesystem uid/gid); default root. */
  fsUid?: number;
  fsGid?: number;
}

export interface WriteFileOptions extends FileOptions {
  mode?: number;
  uid?: number;
  gid?: number;
}
