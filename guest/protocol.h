/*
 * sandboxd guest protocol, version 1. The single source for the numbers is
 * contracts/guest-protocol.ts; tests/style/guest-protocol-drift.test.ts fails when this
 * header and that file disagree. Prose: docs/guest-protocol.md.
 *
 * Frame (little-endian), 12-byte header then payload:
 *   u16 magic (0x5342)  u8 version (1)  u8 type  u32 stream  u32 payload_len
 * Payload of HELLO/REQUEST/RESPONSE is a list of TLV records:
 *   u16 tag  u32 len  value[len]
 * Integers inside TLV values are little-endian u32/i32/u64 by the tag's kind.
 *
 * Tunnels (OP CONNECT: PORT, optional HOST): after a RESPONSE with STATUS 0 the stream carries
 * DATA both ways, each direction limited by CREDIT (u32 bytes granted; SBX_TUNNEL_WINDOW to
 * start). CLOSE ends the whole tunnel (no half-close; empty, or TLV STATUS/ERROR on a failure);
 * the guest answers a host CLOSE with its own. A host hang-up or HELLO closes every tunnel.
 */
#ifndef SANDBOXD_GUEST_PROTOCOL_H
#define SANDBOXD_GUEST_PROTOCOL_H

#define SBX_MAGIC 0x5342
#define SBX_VERSION 1
#define SBX_HEADER_LEN 12
/* 1 MiB: large enough for a file chunk or an exec's bounded output, small enough that a
 * corrupt length cannot make either side allocate without bound. */
#define SBX_MAX_PAYLOAD 1048576
/* An exec's captured stdout+stderr together, at most: one RESPONSE frame less 4 KiB for its
 * other fields. Past it the rest is read and discarded and the *_TRUNC flags are set. */
#define SBX_EXEC_OUTPUT_MAX 1044480

/* frame types */
#define SBX_T_HELLO 1
#define SBX_T_REQUEST 2
#define SBX_T_RESPONSE 3
#define SBX_T_STDIN 4
#define SBX_T_STDOUT 5
#define SBX_T_STDERR 6
#define SBX_T_CANCEL 7
#define SBX_T_DATA 8
#define SBX_T_CLOSE 9
#define SBX_T_CREDIT 10
#define SBX_T_LOG 11
#define SBX_T_OPEN 12 /* guest -> host: a tunnel the guest opened (egress); TLV PORT */
#define SBX_T_RESIZE 13 /* host -> guest on a PTY tunnel: u16 cols, u16 rows (TIOCSWINSZ) */
#define SBX_T_STARTED 14 /* guest -> host: an exec that asked (STREAM bit2) was forked; u32 LE pid */

/* ops (value of SBX_TAG_OP, a u32) */
#define SBX_OP_PING 1
#define SBX_OP_EXEC 2
#define SBX_OP_WRITE_FILE 3
#define SBX_OP_READ_FILE 4
#define SBX_OP_ENTROPY 5
#define SBX_OP_SET_CLOCK 6
#define SBX_OP_SET_HOSTNAME 7
#define SBX_OP_SYNC 8
#define SBX_OP_CONNECT 9
/* WRITE_FILE's fields without DATA; the content follows as STDIN frames, an empty one ends it. */
#define SBX_OP_WRITE_FILE_STREAM 10
/* A shell on a new pseudo-terminal: ARGV (default /bin/bash, else /bin/sh, as a login shell),
 * ENV, CWD, UID, GID, COLS, ROWS. On success the stream is a tunnel whose far end is the PTY
 * master: DATA/CREDIT/CLOSE as for CONNECT, plus RESIZE. */
#define SBX_OP_PTY 11
/* A directory's entries (PATH), at most MAX_BYTES of them: ENTRY records, TRUNCATED past it. */
#define SBX_OP_LIST_DIR 12
/* Removes PATH: a file or symlink (unlink), or an empty directory (rmdir). */
#define SBX_OP_REMOVE 13

/* bits of SBX_TAG_STREAM */
#define SBX_STREAM_OUTPUT 1
#define SBX_STREAM_STDIN 2
#define SBX_STREAM_STARTED 4

/* TLV tags */
#define SBX_TAG_OP 1            /* u32 */
#define SBX_TAG_STATUS 2        /* u32: 0 ok, else an errno value */
#define SBX_TAG_ERROR 3         /* string */
#define SBX_TAG_ARGV 4          /* string, repeated, in order */
#define SBX_TAG_ENV 5           /* string "K=V", repeated: the whole environment */
#define SBX_TAG_CWD 6           /* string */
#define SBX_TAG_UID 7           /* u32 */
#define SBX_TAG_GID 8           /* u32 */
#define SBX_TAG_TIMEOUT_MS 9    /* u32, 0 = none */
#define SBX_TAG_STDIN 10        /* bytes: whole stdin, then EOF */
#define SBX_TAG_MAX_OUTPUT 11   /* u32: per-stream capture cap in bytes */
#define SBX_TAG_STREAM 12       /* u32 flags: bit0 stream output as STDOUT/STDERR frames,
                                   bit1 stdin arrives as STDIN frames (empty frame = EOF) */
#define SBX_TAG_SEED 13         /* bytes mixed into the kernel pool before the exec */
#define SBX_TAG_EXIT_CODE 14    /* i32 */
#define SBX_TAG_SIGNAL 15       /* i32 */
#define SBX_TAG_TIMED_OUT 16    /* u32 0/1 */
#define SBX_TAG_STDOUT 17       /* bytes */
#define SBX_TAG_STDERR 18       /* bytes */
#define SBX_TAG_STDOUT_TRUNC 19 /* u32 0/1 */
#define SBX_TAG_STDERR_TRUNC 20 /* u32 0/1 */
#define SBX_TAG_DURATION_US 21  /* u64: fork to exit */
#define SBX_TAG_SEED_ACK 22     /* u32 1 = mixed and reseeded */
#define SBX_TAG_PATH 23         /* string */
#define SBX_TAG_DATA 24         /* bytes */
#define SBX_TAG_MODE 25         /* u32 */
#define SBX_TAG_MAX_BYTES 26    /* u32 */
#define SBX_TAG_SIZE 27         /* u64 */
#define SBX_TAG_TRUNCATED 28    /* u32 0/1 */
#define SBX_TAG_REALTIME_NS 29  /* u64 */
#define SBX_TAG_HOSTNAME 30     /* string */
#define SBX_TAG_PORT 31         /* u32 */
#define SBX_TAG_PROTO_VERSION 32 /* u32 */
#define SBX_TAG_AGENT_VERSION 33 /* string */
#define SBX_TAG_BOOT_ID 34      /* string */
#define SBX_TAG_UPTIME_MS 35    /* u64 */
#define SBX_TAG_PID 36          /* u32 */
#define SBX_TAG_HOST 37         /* string: IPv4/IPv6 literal a CONNECT dials (default 127.0.0.1) */
#define SBX_TAG_COLS 38         /* u32: PTY width in cells */
#define SBX_TAG_ROWS 39         /* u32: PTY height in cells */
#define SBX_TAG_OFFSET 40       /* u64: READ_FILE starts here (default 0) */
#define SBX_TAG_ENTRY 41        /* LIST_DIR answer, repeated: u8 type, u32 mode, u64 size,
                                   i64 mtime (s), then the name (no NUL) */
#define SBX_TAG_FS_UID 42       /* u32: file ops run with this filesystem uid (setfsuid) */
#define SBX_TAG_FS_GID 43       /* u32: and this filesystem gid, no supplementary groups */

/* LIST_DIR entry types (first byte of an ENTRY) */
#define SBX_ENTRY_FILE 1
#define SBX_ENTRY_DIR 2
#define SBX_ENTRY_SYMLINK 3
#define SBX_ENTRY_OTHER 4
/* Fixed bytes of an ENTRY before its name. */
#define SBX_ENTRY_HEADER_LEN 21

/* Tunnels (OP CONNECT, docs "Tunnels"). Each direction of a tunnel starts with this many bytes of
 * credit once the CONNECT succeeds: a sender never has more DATA payload outstanding than the
 * credit the receiver granted (CREDIT payload: u32 bytes). 256 KiB keeps a virtio-serial link
 * busy while bounding what one tunnel can make either side buffer. */
#define SBX_TUNNEL_WINDOW 262144

/* Stream ids of tunnels the guest opens (OPEN, egress) have this bit set; ids the host chooses
 * never do, so the two sides never pick the same id. */
#define SBX_GUEST_STREAM_BIT 0x80000000u
/* The egress proxy port the guest agent listens on (127.0.0.1) as PID 1. */
#define SBX_EGRESS_PORT 3128

#endif
