/**
 * sandboxd guest protocol, version 1: the numbers shared by the host agent (TypeScript) and
 * the guest agent (C, guest/protocol.h). A drift test compares the two.
 * Prose and semantics: docs/guest-protocol.md.
 */
export const MAGIC = 0x5342;
export const VERSION = 1;
export const HEADER_LEN = 12;
/** 1 MiB: bounds what a corrupt length can make either side allocate. */
export const MAX_PAYLOAD = 1048576;
/**
 * An exec's stdout+stderr together, at most: one RESPONSE frame less 4 KiB for its other fields.
 * The guest reads and discards the rest (its command keeps running) and sets STDOUT_TRUNC /
 * STDERR_TRUNC; the host cuts a longer answer to this too, so the bound does not rest on the guest.
 */
export const EXEC_OUTPUT_MAX = 1044480;

export const FrameType = {
  HELLO: 1,
  REQUEST: 2,
  RESPONSE: 3,
  STDIN: 4,
  STDOUT: 5,
  STDERR: 6,
  CANCEL: 7,
  DATA: 8,
  CLOSE: 9,
  CREDIT: 10,
  LOG: 11,
  OPEN: 12,
  /** Host -> guest on a PTY tunnel (Op.PTY): u16 cols, u16 rows; the guest sets the window size. */
  RESIZE: 13,
  /**
   * Guest -> host on an EXEC stream that asked for it (StreamFlag.STARTED): the command was
   * forked (its cwd and argv accepted); output and the RESPONSE follow. Payload: the command's
   * guest pid, u32 little-endian; empty from an older guest agent (pid unknown until RESPONSE).
   */
  STARTED: 14,
} as const;
export type FrameType = (typeof FrameType)[keyof typeof FrameType];

export const Op = {
  PING: 1,
  EXEC: 2,
  WRITE_FILE: 3,
  READ_FILE: 4,
  ENTROPY: 5,
  SET_CLOCK: 6,
  SET_HOSTNAME: 7,
  SYNC: 8,
  CONNECT: 9,
  /** WRITE_FILE's fields without DATA; the content follows as STDIN frames, an empty one ends it. */
  WRITE_FILE_STREAM: 10,
  /**
   * A shell on a new pseudo-terminal; on success the stream is a tunnel whose far end is the PTY
   * master (DATA/CREDIT/CLOSE as for CONNECT, plus RESIZE). ARGV (default: the image's login
   * shell), ENV, CWD, UID, GID, COLS, ROWS.
   */
  PTY: 11,
  /** A directory's entries (PATH), at most MAX_BYTES of them: ENTRY records, TRUNCATED past it. */
  LIST_DIR: 12,
  /** Removes PATH: a file or symlink (unlink), or an empty directory (rmdir). */
  REMOVE: 13,
} as const;
export type Op = (typeof Op)[keyof typeof Op];

export const Tag = {
  OP: 1,
  STATUS: 2,
  ERROR: 3,
  ARGV: 4,
  ENV: 5,
  CWD: 6,
  UID: 7,
  GID: 8,
  TIMEOUT_MS: 9,
  STDIN: 10,
  MAX_OUTPUT: 11,
  STREAM: 12,
  SEED: 13,
  EXIT_CODE: 14,
  SIGNAL: 15,
  TIMED_OUT: 16,
  STDOUT: 17,
  STDERR: 18,
  STDOUT_TRUNC: 19,
  STDERR_TRUNC: 20,
  DURATION_US: 21,
  SEED_ACK: 22,
  PATH: 23,
  DATA: 24,
  MODE: 25,
  MAX_BYTES: 26,
  SIZE: 27,
  TRUNCATED: 28,
  REALTIME_NS: 29,
  HOSTNAME: 30,
  PORT: 31,
  PROTO_VERSION: 32,
  AGENT_VERSION: 33,
  BOOT_ID: 34,
  UPTIME_MS: 35,
  PID: 36,
  /** CONNECT: IPv4/IPv6 literal to dial inside the guest (default 127.0.0.1). */
  HOST: 37,
  /** PTY: the terminal's width and height in character cells. */
  COLS: 38,
  ROWS: 39,
  /** READ_FILE: where in the file to start (u64, default 0). */
  OFFSET: 40,
  /** LIST_DIR answer, repeated: u8 type, u32 mode, u64 size, i64 mtime (s), then the name. */
  ENTRY: 41,
  /** File ops: the filesystem uid/gid the op runs with (setfsuid/setfsgid; default root). */
  FS_UID: 42,
  FS_GID: 43,
} as const;
export type Tag = (typeof Tag)[keyof typeof Tag];

/**
 * Tunnels (Op.CONNECT): each direction starts with this many bytes of credit once the CONNECT
 * succeeds; a sender never has more DATA payload outstanding than the receiver granted (CREDIT
 * payload: u32 bytes). 256 KiB keeps the virtio-serial link busy while bounding what one tunnel can
 * make either side buffer.
 */
export const TUNNEL_WINDOW = 262144;
/** Stream ids of tunnels the guest opens (OPEN: egress) have this bit; the host's never do. */
export const GUEST_STREAM_BIT = 0x80000000;
/** The egress proxy port the guest agent listens on (127.0.0.1) inside every VM. */
export const EGRESS_PORT = 3128;

/** LIST_DIR entry types (first byte of an ENTRY). */
export const EntryType = { FILE: 1, DIR: 2, SYMLINK: 3, OTHER: 4 } as const;
/** Fixed bytes of an ENTRY before its name. */
export const ENTRY_HEADER_LEN = 21;

/** Bits of Tag.STREAM. */
export const StreamFlag = { OUTPUT: 1, STDIN: 2, STARTED: 4 } as const;
