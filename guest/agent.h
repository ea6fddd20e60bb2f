/*
 * sandboxd guest agent: the declarations its files share. Each file owns one concern and its
 * state; what another file needs is declared here and defined in exactly one file, the one named
 * in its group's banner below. State only one file uses stays static in that file.
 *
 *   main.c      process mode (PID 1 or host test mode), startup order
 *   boot.c      PID 1 boot: mounts, modules, switch root, hostname, loopback
 *   loop.c      the poll() loop, reaping, timers, the monotonic clock
 *   port.c      the port to the host: (re)connecting, output queue, logging, answers
 *   codec.c     the wire codec: integers, TLV, frame header, incremental frame decoder
 *   dispatch.c  HELLO, the REQUEST ops, frames for execs and tunnels routed to their owner
 *   exec.c      EXEC: children, their stdin/stdout/stderr, the answer
 *   tunnel.c    tunnels (OP CONNECT and the egress ones): DATA/CREDIT/CLOSE
 *   egress.c    the guest's egress proxy port: accepted connections become tunnels
 *   pty.c       PTY: a shell on a pseudo-terminal whose master is a tunnel's fd
 *   files.c     WRITE_FILE, WRITE_FILE_STREAM, READ_FILE
 *   fsops.c     LIST_DIR, REMOVE, and the filesystem identity file ops run with
 *   machine.c   entropy, realtime clock, hostname, boot id
 *   queue.c     byte queues for pipes and sockets that were not ready
 *   protocol.h  the wire numbers (kept equal to contracts/guest-protocol.ts by a test)
 */
#ifndef SANDBOXD_GUEST_AGENT_H
#define SANDBOXD_GUEST_AGENT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "protocol.h"

/* ------------------------------------------------------------------------------------------ */
/* bounds more than one file relies on */

/* Fixed fields of an exec RESPONSE (status, pid, exit, flags, duration) fit well inside this;
 * captured output is clamped so that the whole RESPONSE stays within SBX_MAX_PAYLOAD. */
#define RESPONSE_RESERVE 4096
/* Output queue bounds (guest -> host). LOG frames are dropped past the first; execs that stream
 * their output stop reading their pipes past the second (their writers block: backpressure)
 * until the host drains the port. RESPONSE frames are always queued: their number is bounded
 * by MAX_EXECS plus the host's own in-flight requests. */
#define OUTQ_LOG_LIMIT (1u << 20)
#define OUTQ_STREAM_HIGH (4u << 20)
/* Bytes read from one pipe per wakeup, so one chatty exec cannot starve the others. */
#define READ_PASS_MAX (256u << 10)
/* Size of STDOUT/STDERR frames when streaming. */
#define STREAM_CHUNK 65536
/* Bound on tunnels: each costs a socket fd, a poll slot and up to one window (256 KiB) of queued
 * host data, so 128 caps that at 32 MiB even if every reader in the guest stalls. The host needs
 * a few per sandbox; a buggy host must not be able to exhaust PID 1's memory or fds. */
#define MAX_TUNNELS 128
/* Bound on streamed file writes (WRITE_FILE_STREAM) open at once: each holds an fd and a temp
 * file. The host writes one exec's files one after another; 64 leaves room for several sandbox
 * calls at once while a buggy host cannot exhaust PID 1's fds. */
#define MAX_FILE_STREAMS 64

/* ------------------------------------------------------------------------------------------ */
/* main.c: how the agent runs */

extern int host_mode;         /* host test mode: no boot duties, the host's clock etc. left alone */
extern const char *port_path; /* host mode: unix socket to connect to */
extern int console_fd;        /* /dev/console (ttyS0) as PID 1, stderr in host mode */

/* ------------------------------------------------------------------------------------------ */
/* codec.c: the wire codec */

void put32(uint8_t *p, uint32_t v);
uint32_t get32(const uint8_t *p);

/* Growable byte buffer. `failed` latches an allocation failure so builders need no checks. */
struct buf {
  uint8_t *p;
  size_t len, cap;
  int failed;
};
int buf_reserve(struct buf *b, size_t extra);
void buf_free(struct buf *b);

/* TLV record: u16 tag, u32 len, value (docs "Framing"). */
void tlv_put(struct buf *b, uint16_t tag, const void *v, size_t n);
void tlv_u32(struct buf *b, uint16_t tag, uint32_t v);
void tlv_u64(struct buf *b, uint16_t tag, uint64_t v);
void tlv_str(struct buf *b, uint16_t tag, const char *s);

struct tlv {
  uint16_t tag;
  uint32_t len;
  const uint8_t *v;
};
int tlv_next(const uint8_t *p, size_t n, size_t *off, struct tlv *t);
int tlv_valid(const uint8_t *p, size_t n);
int tlv_find(const uint8_t *p, size_t n, uint16_t tag, struct tlv *out);
int tlv_get_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t *v);
int tlv_get_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t *v);
char *tlv_strdup(const struct tlv *t);

void frame_header(uint8_t *h, uint8_t type, uint32_t stream, uint32_t len);
void decoder_reset(void);
void feed(const uint8_t *p, size_t n);

/* ------------------------------------------------------------------------------------------ */
/* port.c: the port to the host */

extern int port_fd;
extern int connected;         /* a host is attached to the port */
extern int64_t next_probe_ms; /* when to look for a host again while disconnected */
struct outframe;
extern struct outframe *outq_head; /* frames not yet written to the port */
extern size_t outq_bytes;

void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void send_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n);
void send_buf(uint8_t type, uint32_t stream, struct buf *b);
void respond_status(uint32_t stream, int err, const char *msg);
void respond_errno(uint32_t stream, int err, const char *what, const char *path);
void flush_out(void);
int open_agent_port(int quiet);
void probe_host(void);
void port_readable(void);

/* ------------------------------------------------------------------------------------------ */
/* dispatch.c */

void dispatch(uint8_t type, uint32_t stream, const uint8_t *p, size_t n);

/* ------------------------------------------------------------------------------------------ */
/* queue.c: bytes queued for a pipe or socket that was not ready */

struct chunk {
  struct chunk *next;
  size_t len, off;
  uint8_t data[];
};
struct chunkq {
  struct chunk *head, *tail;
  size_t bytes;
};
int chunkq_push(struct chunkq *q, const uint8_t *p, size_t n); /* a copy; -1 out of memory */
void chunkq_consumed(struct chunkq *q, size_t n); /* n bytes of the head chunk were written */
void chunkq_clear(struct chunkq *q);

/* ------------------------------------------------------------------------------------------ */
/* exec.c: execs */

struct exec {
  struct exec *next;
  uint32_t stream;
  pid_t pid; /* also the process group and session id (setsid in the child) */
  int in_fd, out_fd, err_fd; /* our pipe ends, -1 once closed */
  struct chunkq in; /* stdin not yet written to the child */
  int in_eof;       /* close stdin once the queue is written */
  struct buf out, err;
  size_t max_output;
  int out_trunc, err_trunc;
  int stream_output, stream_stdin;
  int has_seed, seed_ack;
  int64_t start_us, end_us;
  int64_t deadline_ms;       /* TIMEOUT_MS, 0 none */
  int64_t drain_deadline_ms; /* set when the pid exits */
  int exited, draining, status, timed_out, cancelled;
};

extern struct exec *execs;
extern int n_execs;
extern int detached[];  /* pipes still held by background processes, read and discarded */
extern int n_detached;
extern uint8_t scratch[STREAM_CHUNK]; /* one read buffer: the agent has one thread */

struct exec *find_exec(uint32_t stream);
void kill_group(struct exec *e);
void stdin_push(struct exec *e, const uint8_t *p, size_t n);
void stdin_pump(struct exec *e);
void exec_read(struct exec *e, int which, size_t limit);
void exec_finish(struct exec *e);
void op_exec(uint32_t stream, const uint8_t *p, size_t n);

/* ------------------------------------------------------------------------------------------ */
/* tunnel.c: tunnels */

struct tunnel {
  struct tunnel *next;
  uint32_t stream;
  int fd;                      /* -1 once closed */
  int connecting;              /* non-blocking connect in progress; RESPONSE not sent yet */
  int64_t connect_deadline_ms; /* TUNNEL_CONNECT_MS after the request */
  uint32_t send_credit;        /* DATA bytes we may still send to the host */
  uint32_t recv_credit;        /* DATA bytes the host may still send us */
  uint32_t grant;              /* written into the socket, not yet granted back as CREDIT */
  struct chunkq in;            /* host -> socket bytes not yet written */
  int host_closed;             /* CLOSE received: flush, close, answer CLOSE */
  int64_t linger_deadline_ms;
  int dead;                    /* finished; freed by tunnels_sweep between poll passes */
  pid_t pty_pid;               /* PTY tunnels: the shell (its session id); 0 for sockets */
};

extern struct tunnel *tunnels;
extern int n_tunnels;      /* live ones (the MAX_TUNNELS bound) */
extern int n_tunnel_slots; /* structs in the list, dead ones included (poll set size) */

struct tunnel *find_tunnel(uint32_t stream);
void tunnel_link(struct tunnel *t);
void tunnel_end(struct tunnel *t, int send_close, int err, const char *what);
void tunnels_close_all(const char *why);
void tunnels_sweep(void);
void tunnel_pump(struct tunnel *t);
void tunnel_read(struct tunnel *t);
void tunnel_connected(struct tunnel *t, int timed_out);
void op_connect(uint32_t stream, const uint8_t *p, size_t n);
void tunnel_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n);

/* ------------------------------------------------------------------------------------------ */
/* pty.c: PTY tunnels */

void op_pty(uint32_t stream, const uint8_t *p, size_t n);
void pty_resize(struct tunnel *t, const uint8_t *p, size_t n);
void pty_hangup(struct tunnel *t);
void pty_exited(pid_t pid);
void pty_timers(int64_t now);
int64_t pty_next_deadline(void);

/* ------------------------------------------------------------------------------------------ */
/* egress.c: the egress proxy port */

extern int egress_fd;
void egress_listen(uint32_t port);
void egress_accept(void);

/* ------------------------------------------------------------------------------------------ */
/* files.c */

void op_write_file(uint32_t stream, const uint8_t *p, size_t n);
void op_read_file(uint32_t stream, const uint8_t *p, size_t n);
void op_write_file_stream(uint32_t stream, const uint8_t *p, size_t n);
int is_file_stream(uint32_t stream);
/* A STDIN (content; empty = EOF) or CANCEL frame for a streamed write. */
void file_stream_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n);
/* The host is gone (hang-up or HELLO): every streamed write is dropped with its temp file. */
void file_streams_abort_all(void);
/* A request's PATH, absolute or relative to its CWD (default "/"); NULL once answered. Caller frees. */
char *file_request_path(const uint8_t *p, size_t n, uint32_t stream);

/* ------------------------------------------------------------------------------------------ */
/* fsops.c */

/* The filesystem identity of a file op (FS_UID/FS_GID); `set` 0 = root, nothing changes. */
struct fs_identity {
  int set;
  uint32_t uid, gid;
};
int fs_identity_read(const uint8_t *p, size_t n, struct fs_identity *id); /* -1: bad width */
void fs_identity_enter(const struct fs_identity *id);
void fs_identity_leave(const struct fs_identity *id);
void op_list_dir(uint32_t stream, const uint8_t *p, size_t n);
void op_remove(uint32_t stream, const uint8_t *p, size_t n);

/* ------------------------------------------------------------------------------------------ */
/* machine.c: machine-wide state */

int mix_entropy(const uint8_t *d, size_t n);
void op_entropy(uint32_t stream, const uint8_t *p, size_t n);
void op_set_clock(uint32_t stream, const uint8_t *p, size_t n);
void op_set_hostname(uint32_t stream, const uint8_t *p, size_t n);

/* ------------------------------------------------------------------------------------------ */
/* boot.c: PID 1 boot */

void ensure_std_fds(void);
void early_boot(void);
void boot(void);
/* At boot: the boot id's file bound over its procfs entry, so restores only rewrite it (machine.c). */
void boot_id_bind(void);

/* ------------------------------------------------------------------------------------------ */
/* loop.c: the loop */

extern int sigfd_missing; /* no signalfd: reap by polling */
int64_t mono_us(void);
int64_t mono_ms(void);
void loop(int sigfd);

#endif
