/*
 * sandboxd guest agent: PID 1 of the microVM's initramfs.
 *
 * Boot (only when PID 1): mount /dev, /proc, /sys; load the kernel modules the initramfs lists in
 * /etc/modules.order; mount the image disk (/dev/vda, ext4) and switch root into it so that every
 * exec sees the image's filesystem; open the virtio-serial port named "agent" once, for life.
 * Then serve the guest protocol (docs/guest-protocol.md, numbers in protocol.h) forever.
 *
 * Host test mode (not PID 1, or `--port PATH`): no boot duties; PATH is a unix socket the agent
 * connects to as a client, reconnecting as the guest would after a host disconnect. Commands run
 * directly on the host. This lets the exec/process semantics be tested in milliseconds.
 *
 * Shape: one thread, one poll() loop. SIGCHLD arrives through a signalfd; timers (exec timeouts,
 * output drains, reconnect probes) are deadlines folded into poll's timeout. Nothing in the loop
 * blocks for long: pipes and the port are non-blocking, file ops are bounded in size.
 *
 * PID 1 must never exit: the kernel panics when init dies ("Attempted to kill init"), taking
 * every command in the VM with it. So errors are logged (LOG frames + /dev/console) and the loop
 * goes on; there is no exit() on any path once we are PID 1.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "protocol.h"

#define AGENT_VERSION "sandboxd-agent 0.1.0"

/* Default per-stream capture cap (docs: MAX_OUTPUT default 1 MiB). */
#define DEFAULT_MAX_OUTPUT (1u << 20)
/* Fixed fields of an exec RESPONSE (status, pid, exit, flags, duration) fit well inside this;
 * captured output is clamped so that the whole RESPONSE stays within SBX_MAX_PAYLOAD. */
#define RESPONSE_RESERVE 4096
/* READ_FILE default and cap: the DATA must fit in one RESPONSE frame. */
#define READ_FILE_MAX (SBX_MAX_PAYLOAD - RESPONSE_RESERVE)
/* Bound on execs in flight: each holds up to 3 fds, two capture buffers (<= 2 MiB) and a poll
 * slot; the host never needs more than a few dozen at once, and an unbounded count would let a
 * buggy host exhaust PID 1's memory. */
#define MAX_EXECS 256
/* Bound on pipes kept open after their exec answered (a background process still holds them).
 * Each costs an fd and a poll slot in PID 1; past the cap the oldest is closed (its writer may
 * then get SIGPIPE, which is the lesser evil than PID 1 running out of fds). */
#define MAX_DETACHED 128
/* After the command's own pid exits we wait this long for EOF on its pipes before answering.
 * Everything the command itself wrote is already in the pipe; this covers descendants that
 * are finishing at the same moment (e.g. the last stage of a pipeline the shell did not wait
 * for). A background daemon holding the pipe must not hold the answer, so the wait is short:
 * 20 ms is long enough for a runnable process to be scheduled and small next to a round trip. */
#define DRAIN_MS 20
/* While no host is connected the virtio port reports POLLHUP continuously and there is no poll
 * event for "host connected again", so we look again every 50 ms: cheap (one poll syscall),
 * and it adds at most 50 ms to the first answer after a restore (~150 ms of TCG warm-up
 * anyway). In host mode the same period paces reconnect attempts to the unix socket. */
#define RECONNECT_MS 50
/* When the "agent" port does not exist yet (module still probing) we look again this often. */
#define PORT_RETRY_MS 1000
/* Boot waits for the root disk and the agent port at most this long: virtio devices appear
 * asynchronously after their modules load (probe + devtmpfs node creation), which takes
 * well under a second even under TCG. The bound keeps a misconfigured VM (no disk) from
 * hanging in boot: the agent comes up anyway and reports the problem as LOG frames. */
#define BOOT_WAIT_MS 10000
#define BOOT_POLL_MS 10
/* Output queue bounds (guest -> host). LOG frames are dropped past the first; execs that stream
 * their output stop reading their pipes past the second (their writers block: backpressure)
 * until the host drains the port. RESPONSE frames are always queued: their number is bounded
 * by MAX_EXECS plus the host's own in-flight requests. */
#define OUTQ_LOG_LIMIT (1u << 20)
#define OUTQ_STREAM_HIGH (4u << 20)
/* Streamed stdin (STDIN frames) waiting for the child to read it. The protocol has no credit
 * for exec stdin, so past this the data is dropped and logged rather than grow PID 1 without
 * bound; hosts pace their writes. */
#define STDIN_QUEUE_LIMIT (16u << 20)
/* Bytes read from one pipe per wakeup, so one chatty exec cannot starve the others. */
#define READ_PASS_MAX (256u << 10)
/* The final read before an answer is bounded too: a background writer may never stop. */
#define FINAL_READ_MAX (1u << 20)
/* Size of STDOUT/STDERR frames when streaming. */
#define STREAM_CHUNK 65536

/* linux/random.h is not in musl's headers; the ioctl numbers are ABI. */
#define SBX_RNDADDENTROPY 0x40085203u /* _IOW('R', 0x03, int[2]) */
#define SBX_RNDRESEEDCRNG 0x5207u     /* _IO('R', 0x07), Linux >= 4.17 */
#define SBX_MODULE_INIT_COMPRESSED_FILE 4
#define SBX_RAMFS_MAGIC 0x858458f6u
#define SBX_TMPFS_MAGIC 0x01021994u

/* ------------------------------------------------------------------------------------------ */
/* small helpers */

static int host_mode;
static const char *port_path; /* host mode: unix socket to connect to */
static uint32_t test_egress_port; /* host mode: egress proxy port (0: none; the host's 3128 may be taken) */
static int console_fd = -1;   /* /dev/console (ttyS0) as PID 1, stderr in host mode */

static int64_t mono_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}
static int64_t mono_ms(void) { return mono_us() / 1000; }

static void put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t get64(const uint8_t *p) {
  return (uint64_t)get32(p) | ((uint64_t)get32(p + 4) << 32);
}

static void set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Growable byte buffer. `failed` latches an allocation failure so builders need no checks. */
struct buf {
  uint8_t *p;
  size_t len, cap;
  int failed;
};

static int buf_reserve(struct buf *b, size_t extra) {
  if (b->failed) return -1;
  if (b->len + extra <= b->cap) return 0;
  size_t nc = b->cap ? b->cap : 256;
  while (nc < b->len + extra) nc *= 2;
  uint8_t *np = realloc(b->p, nc);
  if (!np) {
    b->failed = 1;
    return -1;
  }
  b->p = np;
  b->cap = nc;
  return 0;
}
static void buf_put(struct buf *b, const void *d, size_t n) {
  if (n == 0 || buf_reserve(b, n) < 0) return;
  memcpy(b->p + b->len, d, n);
  b->len += n;
}
static void buf_free(struct buf *b) {
  free(b->p);
  memset(b, 0, sizeof *b);
}

/* TLV record: u16 tag, u32 len, value (docs "Framing"). */
static void tlv_put(struct buf *b, uint16_t tag, const void *v, size_t n) {
  uint8_t h[6];
  put16(h, tag);
  put32(h + 2, (uint32_t)n);
  buf_put(b, h, 6);
  buf_put(b, v, n);
}
static void tlv_u32(struct buf *b, uint16_t tag, uint32_t v) {
  uint8_t x[4];
  put32(x, v);
  tlv_put(b, tag, x, 4);
}
static void tlv_u64(struct buf *b, uint16_t tag, uint64_t v) {
  uint8_t x[8];
  put64(x, v);
  tlv_put(b, tag, x, 8);
}
static void tlv_str(struct buf *b, uint16_t tag, const char *s) { tlv_put(b, tag, s, strlen(s)); }

struct tlv {
  uint16_t tag;
  uint32_t len;
  const uint8_t *v;
};

/* Next record at *off: 1 found, 0 end of list, -1 malformed (length past the payload). */
static int tlv_next(const uint8_t *p, size_t n, size_t *off, struct tlv *t) {
  if (*off == n) return 0;
  if (n - *off < 6) return -1;
  t->tag = get16(p + *off);
  t->len = get32(p + *off + 2);
  if (t->len > n - *off - 6) return -1;
  t->v = p + *off + 6;
  *off += 6 + (size_t)t->len;
  return 1;
}
static int tlv_valid(const uint8_t *p, size_t n) {
  size_t off = 0;
  struct tlv t;
  int r;
  while ((r = tlv_next(p, n, &off, &t)) == 1) {
  }
  return r == 0;
}
/* First record with `tag`; unknown tags are simply never asked for (docs: skipped). */
static int tlv_find(const uint8_t *p, size_t n, uint16_t tag, struct tlv *out) {
  size_t off = 0;
  struct tlv t;
  while (tlv_next(p, n, &off, &t) == 1)
    if (t.tag == tag) {
      *out = t;
      return 1;
    }
  return 0;
}
/* 1 found, 0 absent, -1 present with the wrong width. */
static int tlv_get_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t *v) {
  struct tlv t;
  if (!tlv_find(p, n, tag, &t)) return 0;
  if (t.len != 4) return -1;
  *v = get32(t.v);
  return 1;
}
static int tlv_get_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t *v) {
  struct tlv t;
  if (!tlv_find(p, n, tag, &t)) return 0;
  if (t.len != 8) return -1;
  *v = get64(t.v);
  return 1;
}
/* NUL-terminated copy of a string record (a value with an embedded NUL ends there). */
static char *tlv_strdup(const struct tlv *t) { return strndup((const char *)t->v, t->len); }

/* ------------------------------------------------------------------------------------------ */
/* the port: connection state and output queue */

static int port_fd = -1;
static int connected;         /* a host is attached to the port */
static int64_t next_probe_ms; /* when to look for a host again while disconnected */

struct outframe {
  struct outframe *next;
  size_t len, off;
  uint8_t data[];
};
static struct outframe *outq_head, *outq_tail;
static size_t outq_bytes;

static void decoder_reset(void);
static void tunnels_close_all(const char *why);
static void send_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n);

static void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logmsg(const char *fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line) n = sizeof line - 1;
  if (console_fd >= 0) {
    char out[600];
    int m = snprintf(out, sizeof out, "sandboxd-agent: %s\n", line);
    if (m > 0) {
      /* The console is a blocking serial line; a short write loses the rest of one log line,
       * which is acceptable for diagnostics. */
      ssize_t w = write(console_fd, out, (size_t)m < sizeof out ? (size_t)m : sizeof out - 1);
      (void)w;
    }
  }
  send_frame(SBX_T_LOG, 0, (const uint8_t *)line, (size_t)n);
}

static void outq_clear(void) {
  while (outq_head) {
    struct outframe *f = outq_head;
    outq_head = f->next;
    free(f);
  }
  outq_tail = NULL;
  outq_bytes = 0;
}

/* Host went away (EOF/POLLHUP/write error). Execs keep running; what they produce meanwhile
 * is dropped (docs "Reconnects"); partial input is discarded. */
static void host_lost(const char *why, int err) {
  if (!connected) return;
  connected = 0;
  outq_clear();
  decoder_reset();
  tunnels_close_all("host disconnected"); /* the host's side of them is gone */
  next_probe_ms = mono_ms() + RECONNECT_MS;
  if (host_mode && port_fd >= 0) {
    close(port_fd);
    port_fd = -1;
  }
  logmsg("host disconnected (%s%s%s)", why, err ? ": " : "", err ? strerror(err) : "");
}

static void flush_out(void) {
  while (connected && outq_head) {
    struct outframe *f = outq_head;
    ssize_t n = write(port_fd, f->data + f->off, f->len - f->off);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return; /* port full: poll for POLLOUT */
      host_lost("write", errno);
      return;
    }
    f->off += (size_t)n;
    if (f->off == f->len) {
      outq_head = f->next;
      if (!outq_head) outq_tail = NULL;
      outq_bytes -= f->len;
      free(f);
    }
  }
}

static void send_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n) {
  if (!connected || port_fd < 0) return; /* no host: dropped (docs "Reconnects") */
  if (n > SBX_MAX_PAYLOAD) n = SBX_MAX_PAYLOAD; /* callers bound payloads; never exceed the limit */
  if (type == SBX_T_LOG && outq_bytes > OUTQ_LOG_LIMIT) return;
  struct outframe *f = malloc(sizeof *f + SBX_HEADER_LEN + n);
  if (!f) return;
  f->next = NULL;
  f->off = 0;
  f->len = SBX_HEADER_LEN + n;
  put16(f->data, SBX_MAGIC);
  f->data[2] = SBX_VERSION;
  f->data[3] = type;
  put32(f->data + 4, stream);
  put32(f->data + 8, (uint32_t)n);
  if (n) memcpy(f->data + SBX_HEADER_LEN, p, n);
  if (outq_tail)
    outq_tail->next = f;
  else
    outq_head = f;
  outq_tail = f;
  outq_bytes += f->len;
  flush_out();
}

static void send_buf(uint8_t type, uint32_t stream, struct buf *b) {
  if (b->failed) {
    /* Out of memory building the answer: still answer, minimally, so the host does not wait. */
    struct buf e = {0};
    tlv_u32(&e, SBX_TAG_STATUS, ENOMEM);
    tlv_str(&e, SBX_TAG_ERROR, "out of memory building response");
    send_frame(type, stream, e.p, e.len);
    buf_free(&e);
    return;
  }
  send_frame(type, stream, b->p, b->len);
}

static void respond_status(uint32_t stream, int err, const char *msg) {
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, (uint32_t)err);
  if (err && msg) tlv_str(&b, SBX_TAG_ERROR, msg);
  send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);
}

static void respond_errno(uint32_t stream, int err, const char *what, const char *path) {
  char msg[600];
  snprintf(msg, sizeof msg, "%s%s%s: %s", what, path ? " " : "", path ? path : "", strerror(err));
  respond_status(stream, err, msg);
}

/* ------------------------------------------------------------------------------------------ */
/* finding and (re)connecting to the host */

/* /sys/class/virtio-ports/<vportNpM>/name holds the name QEMU gave the port ("agent"). */
static int find_agent_port(char *dev, size_t devlen) {
  DIR *d = opendir("/sys/class/virtio-ports");
  if (!d) return -1;
  struct dirent *de;
  int found = -1;
  while ((de = readdir(d))) {
    if (de->d_name[0] == '.') continue;
    char p[512], name[64];
    snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", de->d_name);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ssize_t n = read(fd, name, sizeof name - 1);
    close(fd);
    if (n <= 0) continue;
    name[n] = 0;
    if (name[n - 1] == '\n') name[n - 1] = 0;
    if (strcmp(name, "agent") == 0) {
      snprintf(dev, devlen, "/dev/%s", de->d_name);
      found = 0;
      break;
    }
  }
  closedir(d);
  return found;
}

/* Opened once for the agent's whole life: a second open of a virtio port gets EBUSY
 * (host-facts "Agent channel"). */
static int open_agent_port(int quiet) {
  char dev[300];
  if (find_agent_port(dev, sizeof dev) < 0) {
    if (!quiet) logmsg("virtio port \"agent\" not found yet");
    return -1;
  }
  int fd = open(dev, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    if (!quiet) logmsg("open %s: %s", dev, strerror(errno));
    return -1;
  }
  port_fd = fd;
  logmsg("agent port %s", dev);
  return 0;
}

/* Called while disconnected, at most every RECONNECT_MS. */
static void probe_host(void) {
  next_probe_ms = mono_ms() + RECONNECT_MS;
  if (host_mode) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return;
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", port_path);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
      close(fd); /* not listening yet (ENOENT/ECONNREFUSED) or backlog full: try again later */
      return;
    }
    port_fd = fd;
  } else {
    if (port_fd < 0 && open_agent_port(1) < 0) {
      next_probe_ms = mono_ms() + PORT_RETRY_MS;
      return;
    }
    struct pollfd p = {.fd = port_fd, .events = POLLIN};
    if (poll(&p, 1, 0) < 0) return;
    /* virtio_console reports POLLHUP for as long as host_connected is false. */
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return;
  }
  connected = 1;
  decoder_reset(); /* drop any partial input from before the disconnect */
  logmsg("host connected");
}

/* ------------------------------------------------------------------------------------------ */
/* execs */

struct chunk {
  struct chunk *next;
  size_t len, off;
  uint8_t data[];
};

struct exec {
  struct exec *next;
  uint32_t stream;
  pid_t pid; /* also the process group and session id (setsid in the child) */
  int in_fd, out_fd, err_fd; /* our pipe ends, -1 once closed */
  struct chunk *in_head, *in_tail;
  size_t in_bytes;
  int in_eof; /* close stdin once the queue is written */
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

static struct exec *execs;
static int n_execs;
static int detached[MAX_DETACHED];
static int n_detached;
static uint8_t scratch[STREAM_CHUNK];

struct tunnel;
static struct tunnel *find_tunnel(uint32_t stream);

static struct exec *find_exec(uint32_t stream) {
  for (struct exec *e = execs; e; e = e->next)
    if (e->stream == stream) return e;
  return NULL;
}

static void kill_group(struct exec *e) {
  if (e->exited) return; /* reaped: its pid may be reused, never signal it */
  /* The command is a session and group leader; SIGKILL the whole group so descendants that
   * stayed in it (a grandchild `sleep`) die too. Before the child's setsid() ran the group
   * does not exist yet: kill the pid itself. */
  if (kill(-e->pid, SIGKILL) < 0) kill(e->pid, SIGKILL);
}

static void stdin_clear(struct exec *e) {
  while (e->in_head) {
    struct chunk *c = e->in_head;
    e->in_head = c->next;
    free(c);
  }
  e->in_tail = NULL;
  e->in_bytes = 0;
}

static void stdin_push(struct exec *e, const uint8_t *p, size_t n) {
  if (e->in_bytes + n > STDIN_QUEUE_LIMIT) {
    logmsg("stream %u: stdin queue over %u bytes, dropping %zu bytes", e->stream, STDIN_QUEUE_LIMIT, n);
    return;
  }
  struct chunk *c = malloc(sizeof *c + n);
  if (!c) return;
  c->next = NULL;
  c->len = n;
  c->off = 0;
  memcpy(c->data, p, n);
  if (e->in_tail)
    e->in_tail->next = c;
  else
    e->in_head = c;
  e->in_tail = c;
  e->in_bytes += n;
}

/* Write queued stdin without blocking; close the pipe at EOF. The child closing its stdin
 * early (EPIPE; SIGPIPE is ignored in the agent) just discards the rest. */
static void stdin_pump(struct exec *e) {
  while (e->in_fd >= 0 && e->in_head) {
    struct chunk *c = e->in_head;
    ssize_t n = write(e->in_fd, c->data + c->off, c->len - c->off);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return;
      stdin_clear(e);
      close(e->in_fd);
      e->in_fd = -1;
      return;
    }
    c->off += (size_t)n;
    if (c->off == c->len) {
      e->in_head = c->next;
      if (!e->in_head) e->in_tail = NULL;
      e->in_bytes -= c->len;
      free(c);
    }
  }
  if (e->in_fd >= 0 && !e->in_head && e->in_eof) {
    close(e->in_fd);
    e->in_fd = -1;
  }
}

/* Read one of the exec's pipes (1 stdout, 2 stderr), at most `limit` bytes this pass. Captured
 * output stops at max_output (the rest is read and discarded, flag set); streamed output goes
 * out as frames. */
static void exec_read(struct exec *e, int which, size_t limit) {
  int *fdp = which == 1 ? &e->out_fd : &e->err_fd;
  struct buf *b = which == 1 ? &e->out : &e->err;
  int *trunc = which == 1 ? &e->out_trunc : &e->err_trunc;
  size_t done = 0;
  while (*fdp >= 0 && done < limit) {
    uint8_t *dst = scratch;
    size_t want = sizeof scratch;
    int capture = !e->stream_output && b->len < e->max_output;
    if (capture) {
      want = e->max_output - b->len;
      if (want > STREAM_CHUNK) want = STREAM_CHUNK;
      if (buf_reserve(b, want) < 0) {
        capture = 0;
        want = sizeof scratch;
      } else {
        dst = b->p + b->len;
      }
    }
    ssize_t n = read(*fdp, dst, want);
    if (n > 0) {
      done += (size_t)n;
      if (e->stream_output)
        send_frame(which == 1 ? SBX_T_STDOUT : SBX_T_STDERR, e->stream, scratch, (size_t)n);
      else if (capture)
        b->len += (size_t)n;
      else
        *trunc = 1;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    close(*fdp); /* EOF (every writer closed) or an error */
    *fdp = -1;
  }
}

static void detach_fd(int fd) {
  if (n_detached == MAX_DETACHED) {
    logmsg("more than %d detached pipes, closing the oldest", MAX_DETACHED);
    close(detached[0]);
    memmove(detached, detached + 1, sizeof detached[0] * (MAX_DETACHED - 1));
    n_detached--;
  }
  detached[n_detached++] = fd;
}

static void exec_free(struct exec *e) {
  stdin_clear(e);
  buf_free(&e->out);
  buf_free(&e->err);
  free(e);
}

/* The command's pid exited and its pipes drained (or the drain timed out): answer. */
static void exec_finish(struct exec *e) {
  exec_read(e, 1, FINAL_READ_MAX);
  exec_read(e, 2, FINAL_READ_MAX);

  size_t o = e->out.len, r = e->err.len;
  if (!e->stream_output) {
    /* Both captures together must fit one RESPONSE frame (SBX_MAX_PAYLOAD); when they do not,
     * the smaller keeps what it has up to half and the larger gets the rest. */
    size_t budget = SBX_MAX_PAYLOAD - RESPONSE_RESERVE, half = budget / 2;
    if (o + r > budget) {
      if (o <= half)
        r = budget - o;
      else if (r <= half)
        o = budget - r;
      else
        o = half, r = budget - half;
    }
    if (o < e->out.len) e->out_trunc = 1;
    if (r < e->err.len) e->err_trunc = 1;
  }

  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  tlv_u32(&b, SBX_TAG_PID, (uint32_t)e->pid);
  tlv_u64(&b, SBX_TAG_DURATION_US, (uint64_t)(e->end_us - e->start_us));
  if (WIFEXITED(e->status)) {
    tlv_u32(&b, SBX_TAG_EXIT_CODE, (uint32_t)WEXITSTATUS(e->status));
  } else if (WIFSIGNALED(e->status)) {
    tlv_u32(&b, SBX_TAG_SIGNAL, (uint32_t)WTERMSIG(e->status));
  }
  tlv_u32(&b, SBX_TAG_TIMED_OUT, (uint32_t)e->timed_out);
  tlv_u32(&b, SBX_TAG_STDOUT_TRUNC, (uint32_t)e->out_trunc);
  tlv_u32(&b, SBX_TAG_STDERR_TRUNC, (uint32_t)e->err_trunc);
  if (!e->stream_output) {
    tlv_put(&b, SBX_TAG_STDOUT, e->out.p, o);
    tlv_put(&b, SBX_TAG_STDERR, e->err.p, r);
  }
  if (e->has_seed) tlv_u32(&b, SBX_TAG_SEED_ACK, (uint32_t)e->seed_ack);
  send_buf(SBX_T_RESPONSE, e->stream, &b);
  buf_free(&b);

  /* Pipes still open are held by background processes the command left behind. Keep reading
   * and discarding so they never block or get SIGPIPE (docs: they survive). */
  if (e->out_fd >= 0) detach_fd(e->out_fd);
  if (e->err_fd >= 0) detach_fd(e->err_fd);
  if (e->in_fd >= 0) close(e->in_fd);
  n_execs--;
  exec_free(e);
}

static int mix_entropy(const uint8_t *d, size_t n);

extern char **environ;

/* In the forked child: never returns. Only the child's own state is touched. */
static void child_exec(struct exec *e, int in_rd, int out_wr, int err_wr, const char *cwd, int have_uid,
                       uint32_t uid, int have_gid, uint32_t gid, char **argv, char **envp) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL); /* SIGCHLD is blocked in the agent (signalfd) */
  signal(SIGPIPE, SIG_DFL);              /* ignored dispositions survive exec: restore */
  setsid();                              /* own session and process group (docs: EXEC) */
  int nul = -1;
  if (in_rd < 0) in_rd = nul = open("/dev/null", O_RDONLY);
  if (in_rd >= 0) dup2(in_rd, 0);
  dup2(out_wr, 1);
  dup2(err_wr, 2);
  if (nul > 2) close(nul);
  /* Every other fd of the agent is O_CLOEXEC. */
  if (chdir(cwd) < 0) {
    dprintf(2, "sandboxd-agent: chdir %s: %s\n", cwd, strerror(errno));
    _exit(126);
  }
  if (have_uid || have_gid) {
    if (geteuid() == 0 && setgroups(0, NULL) < 0) {
      dprintf(2, "sandboxd-agent: setgroups: %s\n", strerror(errno));
      _exit(126);
    }
    if (have_gid && setgid((gid_t)gid) < 0) {
      dprintf(2, "sandboxd-agent: setgid %u: %s\n", gid, strerror(errno));
      _exit(126);
    }
    if (have_uid && setuid((uid_t)uid) < 0) {
      dprintf(2, "sandboxd-agent: setuid %u: %s\n", uid, strerror(errno));
      _exit(126);
    }
  }
  (void)e;
  /* musl's execvpe searches the PATH of the *calling* process, not of envp: install envp as
   * our environment first so execvp searches the PATH the host sent (docs: EXEC ARGV). */
  environ = envp;
  execvp(argv[0], argv);
  int err = errno;
  if (err == ENOENT)
    dprintf(2, "%s: command not found\n", argv[0]);
  else
    dprintf(2, "%s: %s\n", argv[0], strerror(err));
  _exit(err == ENOENT ? 127 : 126); /* as a shell does */
}

static void op_exec(uint32_t stream, const uint8_t *p, size_t n) {
  if (n_execs >= MAX_EXECS) {
    respond_status(stream, EAGAIN, "too many execs in flight");
    return;
  }
  if (find_exec(stream) || find_tunnel(stream)) {
    respond_status(stream, EEXIST, "stream id already in use by a running exec or tunnel");
    return;
  }
  size_t nargv = 0, nenv = 0, off = 0;
  struct tlv t;
  while (tlv_next(p, n, &off, &t) == 1) {
    if (t.tag == SBX_TAG_ARGV) nargv++;
    if (t.tag == SBX_TAG_ENV) nenv++;
  }
  if (nargv == 0) {
    respond_status(stream, EINVAL, "exec: empty argv");
    return;
  }
  uint32_t uid = 0, gid = 0, timeout_ms = 0, max_output = DEFAULT_MAX_OUTPUT, flags = 0;
  int have_uid = tlv_get_u32(p, n, SBX_TAG_UID, &uid);
  int have_gid = tlv_get_u32(p, n, SBX_TAG_GID, &gid);
  if (have_uid < 0 || have_gid < 0 || tlv_get_u32(p, n, SBX_TAG_TIMEOUT_MS, &timeout_ms) < 0 ||
      tlv_get_u32(p, n, SBX_TAG_MAX_OUTPUT, &max_output) < 0 || tlv_get_u32(p, n, SBX_TAG_STREAM, &flags) < 0) {
    respond_status(stream, EINVAL, "exec: integer field of the wrong width");
    return;
  }
  if (max_output > SBX_MAX_PAYLOAD) max_output = SBX_MAX_PAYLOAD;

  char **argv = calloc(nargv + 1, sizeof *argv), **envp = calloc(nenv + 1, sizeof *envp);
  char *cwd = NULL;
  struct exec *e = calloc(1, sizeof *e);
  int in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  if (!argv || !envp || !e) {
    respond_status(stream, ENOMEM, "exec: out of memory");
    goto out;
  }
  size_t ia = 0, ie = 0;
  off = 0;
  while (tlv_next(p, n, &off, &t) == 1) {
    if (t.tag == SBX_TAG_ARGV) argv[ia++] = tlv_strdup(&t);
    if (t.tag == SBX_TAG_ENV) envp[ie++] = tlv_strdup(&t);
  }
  cwd = tlv_find(p, n, SBX_TAG_CWD, &t) && t.len ? tlv_strdup(&t) : strdup("/");
  int oom = !cwd;
  for (size_t i = 0; i < nargv; i++) oom |= !argv[i];
  for (size_t i = 0; i < nenv; i++) oom |= !envp[i];
  if (oom) {
    respond_status(stream, ENOMEM, "exec: out of memory");
    goto out;
  }
  /* A bad working directory is the request's fault, not the command's: answer with an error
   * status instead of running anything. */
  struct stat st;
  if (stat(cwd, &st) < 0) {
    respond_errno(stream, errno, "exec: cwd", cwd);
    goto out;
  }
  if (!S_ISDIR(st.st_mode)) {
    respond_errno(stream, ENOTDIR, "exec: cwd", cwd);
    goto out;
  }

  e->stream = stream;
  e->in_fd = e->out_fd = e->err_fd = -1;
  e->max_output = max_output;
  e->stream_output = (flags & 1) != 0;
  e->stream_stdin = (flags & 2) != 0;

  /* SEED: mixed like ENTROPY before the command runs, so it sees fresh randomness. */
  if (tlv_find(p, n, SBX_TAG_SEED, &t)) {
    e->has_seed = 1;
    e->seed_ack = mix_entropy(t.v, t.len) == 0;
  }

  struct tlv stdin_tlv;
  int have_stdin = tlv_find(p, n, SBX_TAG_STDIN, &stdin_tlv);
  if ((have_stdin || e->stream_stdin) && pipe2(in_pipe, O_CLOEXEC) < 0) {
    respond_errno(stream, errno, "exec: pipe", NULL);
    goto out;
  }
  if (pipe2(out_pipe, O_CLOEXEC) < 0 || pipe2(err_pipe, O_CLOEXEC) < 0) {
    respond_errno(stream, errno, "exec: pipe", NULL);
    goto out;
  }

  e->start_us = mono_us();
  pid_t pid = fork();
  if (pid < 0) {
    respond_errno(stream, errno, "exec: fork", NULL);
    goto out;
  }
  if (pid == 0)
    child_exec(e, in_pipe[0], out_pipe[1], err_pipe[1], cwd, have_uid, uid, have_gid, gid, argv, envp);

  e->pid = pid;
  close(out_pipe[1]);
  close(err_pipe[1]);
  e->out_fd = out_pipe[0];
  e->err_fd = err_pipe[0];
  set_nonblock(e->out_fd);
  set_nonblock(e->err_fd);
  if (in_pipe[0] >= 0) {
    close(in_pipe[0]);
    e->in_fd = in_pipe[1];
    set_nonblock(e->in_fd);
    if (have_stdin) {
      if (stdin_tlv.len) stdin_push(e, stdin_tlv.v, stdin_tlv.len);
      /* Inline stdin is the whole stdin, unless the host also streams more. */
      if (!e->stream_stdin) e->in_eof = 1;
    }
  }
  in_pipe[0] = in_pipe[1] = out_pipe[0] = out_pipe[1] = err_pipe[0] = err_pipe[1] = -1;
  if (timeout_ms) e->deadline_ms = mono_ms() + timeout_ms;
  e->next = execs;
  execs = e;
  n_execs++;
  stdin_pump(e);
  e = NULL; /* owned by the list now */

out:
  for (int i = 0; i < 2; i++) {
    if (in_pipe[i] >= 0) close(in_pipe[i]);
    if (out_pipe[i] >= 0) close(out_pipe[i]);
    if (err_pipe[i] >= 0) close(err_pipe[i]);
  }
  if (e) exec_free(e);
  if (argv)
    for (size_t i = 0; i < nargv; i++) free(argv[i]);
  if (envp)
    for (size_t i = 0; i < nenv; i++) free(envp[i]);
  free(argv);
  free(envp);
  free(cwd);
}

/* ------------------------------------------------------------------------------------------ */
/* tunnels (OP CONNECT): a raw byte duplex between the host and a TCP socket in the guest
 *
 * After a successful RESPONSE the stream carries DATA both ways. Each direction has credit
 * (SBX_TUNNEL_WINDOW bytes to start): we read the socket only while the host has granted us
 * room, and grant the host CREDIT only for bytes already written into the socket. So what a
 * tunnel can hold in PID 1 is bounded by one window per direction, whatever the speed of either
 * end, and a slow reader on either side exerts back-pressure all the way to the writer.
 *
 * Closing (docs "Tunnels"): there is no half-close. EOF or an error on the socket sends CLOSE
 * (after the DATA already read; an error rides in the CLOSE as STATUS/ERROR) and frees the
 * tunnel. A CLOSE from the host stops reading, writes what the host already sent into the socket
 * (at most TUNNEL_LINGER_MS), closes it and answers CLOSE: the host sees exactly one CLOSE per
 * tunnel from us, after which its stream id is free again. Frames for unknown streams are
 * dropped: they cross a CLOSE in flight.
 */

/* Bound on tunnels: each costs a socket fd, a poll slot and up to one window (256 KiB) of queued
 * host data, so 128 caps that at 32 MiB even if every reader in the guest stalls. The host needs
 * a few per sandbox; a buggy host must not be able to exhaust PID 1's memory or fds. */
#define MAX_TUNNELS 128
/* A CONNECT still in progress after this long fails with ETIMEDOUT. Loopback connects finish at
 * once (or are refused at once); the bound is for a HOST that silently drops SYNs, where the
 * kernel's own retry schedule would take minutes while the host caller waits. */
#define TUNNEL_CONNECT_MS 10000
/* After the host's CLOSE we still write what it sent before (the request before a hang-up). A
 * guest reader that never drains must not hold the socket and its queue for ever: 5 s. */
#define TUNNEL_LINGER_MS 5000
/* CREDIT is granted in batches of at least this many bytes (or when the queue empties), so a
 * stream of small socket writes does not answer every DATA frame with a CREDIT frame. */
#define TUNNEL_GRANT_BATCH (SBX_TUNNEL_WINDOW / 4)

struct tunnel {
  struct tunnel *next;
  uint32_t stream;
  int fd;                      /* -1 once closed */
  int connecting;              /* non-blocking connect in progress; RESPONSE not sent yet */
  int64_t connect_deadline_ms; /* TUNNEL_CONNECT_MS after the request */
  uint32_t send_credit;        /* DATA bytes we may still send to the host */
  uint32_t recv_credit;        /* DATA bytes the host may still send us */
  uint32_t grant;              /* written into the socket, not yet granted back as CREDIT */
  struct chunk *in_head, *in_tail; /* host -> socket bytes not yet written */
  size_t in_bytes;
  int host_closed;             /* CLOSE received: flush, close, answer CLOSE */
  int64_t linger_deadline_ms;
  int dead;                    /* finished; freed by tunnels_sweep between poll passes */
};

static struct tunnel *tunnels;
static int n_tunnels;      /* live ones (the MAX_TUNNELS bound) */
static int n_tunnel_slots; /* structs in the list, dead ones included (poll set size) */

static struct tunnel *find_tunnel(uint32_t stream) {
  for (struct tunnel *t = tunnels; t; t = t->next)
    if (t->stream == stream && !t->dead) return t;
  return NULL;
}

static void tunnel_queue_clear(struct tunnel *t) {
  while (t->in_head) {
    struct chunk *c = t->in_head;
    t->in_head = c->next;
    free(c);
  }
  t->in_tail = NULL;
  t->in_bytes = 0;
}

/* Ends a tunnel: the socket is closed now, the struct is freed by tunnels_sweep (a poll pass may
 * still hold a pointer to it). `send_close`: tell the host (err 0 = clean EOF). */
static void tunnel_end(struct tunnel *t, int send_close, int err, const char *what) {
  if (t->dead) return;
  t->dead = 1;
  n_tunnels--;
  if (t->fd >= 0) close(t->fd);
  t->fd = -1;
  tunnel_queue_clear(t);
  if (!send_close) return;
  if (!err) {
    send_frame(SBX_T_CLOSE, t->stream, NULL, 0);
    return;
  }
  char msg[200];
  snprintf(msg, sizeof msg, "tunnel %s: %s", what, strerror(err));
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, (uint32_t)err);
  tlv_str(&b, SBX_TAG_ERROR, msg);
  send_buf(SBX_T_CLOSE, t->stream, &b);
  buf_free(&b);
}

/* The host is gone (disconnect) or starts afresh (HELLO): its tunnel state is gone, so ours goes
 * too, without frames. This is also what keeps a snapshot-restored fork child from inheriting
 * its parent's tunnels: its host reconnects and sends HELLO before anything else. */
static void tunnels_close_all(const char *why) {
  int n = 0;
  for (struct tunnel *t = tunnels; t; t = t->next)
    if (!t->dead) {
      tunnel_end(t, 0, 0, NULL);
      n++;
    }
  if (n) logmsg("%d tunnel(s) closed: %s", n, why);
}

static void tunnels_sweep(void) {
  struct tunnel **pp = &tunnels;
  while (*pp) { /* bounded by MAX_TUNNELS plus those ended since the last sweep */
    struct tunnel *t = *pp;
    if (t->dead) {
      *pp = t->next;
      n_tunnel_slots--;
      free(t);
      continue;
    }
    pp = &t->next;
  }
}

static void tunnel_grant(struct tunnel *t, int force) {
  if (t->dead || t->host_closed || t->grant == 0) return;
  if (!force && t->grant < TUNNEL_GRANT_BATCH) return;
  uint8_t v[4];
  put32(v, t->grant);
  send_frame(SBX_T_CREDIT, t->stream, v, 4);
  t->recv_credit += t->grant;
  t->grant = 0;
}

/* Writes queued host data into the socket without blocking; grants CREDIT for what went in. */
static void tunnel_pump(struct tunnel *t) {
  while (!t->dead && t->in_head) { /* ends at EAGAIN or an empty queue (<= one window) */
    struct chunk *c = t->in_head;
    ssize_t n = write(t->fd, c->data + c->off, c->len - c->off);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) break;
      tunnel_end(t, 1, errno, "write"); /* EPIPE/ECONNRESET: the guest side is gone */
      return;
    }
    c->off += (size_t)n;
    t->grant += (uint32_t)n;
    if (c->off == c->len) {
      t->in_head = c->next;
      if (!t->in_head) t->in_tail = NULL;
      t->in_bytes -= c->len;
      free(c);
    }
  }
  if (t->dead) return;
  if (t->host_closed && !t->in_head) {
    tunnel_end(t, 1, 0, NULL); /* flushed: close and answer the host's CLOSE */
    return;
  }
  tunnel_grant(t, t->in_head == NULL);
}

/* Reads the socket while the host has credit; at most READ_PASS_MAX per wakeup (fairness). */
static void tunnel_read(struct tunnel *t) {
  size_t done = 0;
  while (!t->dead && !t->host_closed && t->send_credit > 0 && done < READ_PASS_MAX) {
    size_t want = t->send_credit < sizeof scratch ? t->send_credit : sizeof scratch;
    ssize_t n = read(t->fd, scratch, want);
    if (n > 0) {
      send_frame(SBX_T_DATA, t->stream, scratch, (size_t)n);
      t->send_credit -= (uint32_t)n;
      done += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    /* EOF or an error: what the peer sent before is already queued to the host, ahead of the
     * CLOSE. Host data not yet written is dropped with the socket (no half-close, see above). */
    tunnel_end(t, 1, n < 0 ? errno : 0, "read");
    return;
  }
}

/* The non-blocking connect finished (POLLOUT/POLLERR) or timed out. */
static void tunnel_connected(struct tunnel *t, int timed_out) {
  int err = 0;
  socklen_t len = sizeof err;
  if (timed_out)
    err = ETIMEDOUT;
  else if (getsockopt(t->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
    err = errno;
  t->connecting = 0;
  if (err) {
    respond_errno(t->stream, err, "connect", NULL);
    tunnel_end(t, 0, 0, NULL); /* the RESPONSE was the stream's final answer */
    return;
  }
  t->send_credit = t->recv_credit = SBX_TUNNEL_WINDOW;
  respond_status(t->stream, 0, NULL);
}

static void op_connect(uint32_t stream, const uint8_t *p, size_t n) {
  if (n_tunnels >= MAX_TUNNELS) {
    respond_status(stream, EAGAIN, "connect: too many tunnels");
    return;
  }
  if (find_tunnel(stream) || find_exec(stream)) {
    respond_status(stream, EEXIST, "connect: stream id already in use");
    return;
  }
  uint32_t port = 0;
  if (tlv_get_u32(p, n, SBX_TAG_PORT, &port) != 1 || port == 0 || port > 65535) {
    respond_status(stream, EINVAL, "connect: PORT missing or not in 1..65535");
    return;
  }
  char host[64] = "127.0.0.1";
  struct tlv t;
  if (tlv_find(p, n, SBX_TAG_HOST, &t)) {
    if (t.len == 0 || t.len >= sizeof host) {
      respond_status(stream, EINVAL, "connect: HOST is not an IP address");
      return;
    }
    memcpy(host, t.v, t.len);
    host[t.len] = 0;
  }
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof ss);
  socklen_t sl;
  struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
  struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
  if (inet_pton(AF_INET, host, &s4->sin_addr) == 1) {
    s4->sin_family = AF_INET;
    s4->sin_port = htons((uint16_t)port);
    sl = sizeof *s4;
  } else if (inet_pton(AF_INET6, host, &s6->sin6_addr) == 1) {
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons((uint16_t)port);
    sl = sizeof *s6;
  } else {
    respond_status(stream, EINVAL, "connect: HOST is not an IP address");
    return;
  }
  int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    respond_errno(stream, errno, "connect: socket", NULL);
    return;
  }
  struct tunnel *tn = calloc(1, sizeof *tn);
  if (!tn) {
    close(fd);
    respond_status(stream, ENOMEM, "connect: out of memory");
    return;
  }
  tn->stream = stream;
  tn->fd = fd;
  tn->next = tunnels;
  tunnels = tn;
  n_tunnels++;
  n_tunnel_slots++;
  if (connect(fd, (struct sockaddr *)&ss, sl) == 0) {
    tunnel_connected(tn, 0);
  } else if (errno == EINPROGRESS || errno == EINTR) {
    tn->connecting = 1; /* POLLOUT tells when it is done */
    tn->connect_deadline_ms = mono_ms() + TUNNEL_CONNECT_MS;
  } else {
    respond_errno(stream, errno, "connect", NULL);
    tunnel_end(tn, 0, 0, NULL);
  }
}

/* Egress (docs "Egress"): the guest has no network interface; its one way out is this proxy port
 * on loopback (every exec gets http_proxy & co. pointing at it). Each connection accepted here
 * becomes a tunnel that WE open: an OPEN frame on a stream id with SBX_GUEST_STREAM_BIT, then
 * DATA/CREDIT/CLOSE exactly as for CONNECT. The host agent reads the proxy request, checks it
 * against the sandbox's allow-list and connects (or refuses) on the host; nothing is decided
 * here. */
static int egress_fd = -1;
static uint32_t egress_port;
static uint32_t next_guest_stream;

static void egress_listen(uint32_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    logmsg("egress socket: %s", strerror(errno));
    return;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  /* Backlog 64: a burst of client connects waits in the kernel while the loop takes them. */
  if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 64) < 0) {
    logmsg("egress listen on 127.0.0.1:%u: %s", port, strerror(errno));
    close(fd);
    return;
  }
  egress_fd = fd;
  egress_port = port;
}

/* Refuses a client at once with a reset (not a silent close), so it fails fast instead of
 * waiting for a proxy answer that will not come. */
static void egress_refuse(int fd) {
  struct linger l = {.l_onoff = 1, .l_linger = 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
}

static void egress_accept(void) {
  /* At most 16 per pass: a flood of connects must not starve the port and the execs. */
  for (int i = 0; i < 16; i++) {
    int fd = accept4(egress_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return; /* EAGAIN: none left; other errors (EMFILE...): try next pass */
    if (!connected || n_tunnels >= MAX_TUNNELS) {
      egress_refuse(fd); /* no host to decide, or no room: refused, never left hanging */
      continue;
    }
    struct tunnel *tn = calloc(1, sizeof *tn);
    if (!tn) {
      egress_refuse(fd);
      continue;
    }
    uint32_t stream;
    do /* bounded: at most MAX_TUNNELS ids are taken */
      stream = SBX_GUEST_STREAM_BIT | (next_guest_stream++ & ~SBX_GUEST_STREAM_BIT);
    while (find_tunnel(stream));
    tn->stream = stream;
    tn->fd = fd;
    tn->send_credit = tn->recv_credit = SBX_TUNNEL_WINDOW;
    tn->next = tunnels;
    tunnels = tn;
    n_tunnels++;
    n_tunnel_slots++;
    struct buf b = {0};
    tlv_u32(&b, SBX_TAG_PORT, egress_port);
    send_buf(SBX_T_OPEN, stream, &b);
    buf_free(&b);
  }
}

static void tunnel_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n) {
  struct tunnel *t = find_tunnel(stream);
  /* Unknown (already closed: the frame crossed our CLOSE), or still connecting (the host must
   * wait for the RESPONSE): dropped. */
  if (!t || t->connecting) return;
  switch (type) {
  case SBX_T_DATA: {
    if (t->host_closed || n == 0) return;
    if (n > t->recv_credit) {
      logmsg("tunnel %u: host sent %zu bytes with %u of credit", stream, n, t->recv_credit);
      tunnel_end(t, 1, EPROTO, "credit");
      return;
    }
    struct chunk *c = malloc(sizeof *c + n);
    if (!c) {
      tunnel_end(t, 1, ENOMEM, "queue");
      return;
    }
    c->next = NULL;
    c->len = n;
    c->off = 0;
    memcpy(c->data, p, n);
    if (t->in_tail)
      t->in_tail->next = c;
    else
      t->in_head = c;
    t->in_tail = c;
    t->in_bytes += n;
    t->recv_credit -= (uint32_t)n;
    tunnel_pump(t);
    return;
  }
  case SBX_T_CREDIT: {
    if (n != 4) return;
    uint64_t c64 = (uint64_t)t->send_credit + get32(p);
    /* A correct host only returns what it consumed; never trust more than one window. */
    t->send_credit = c64 > SBX_TUNNEL_WINDOW ? SBX_TUNNEL_WINDOW : (uint32_t)c64;
    return;
  }
  case SBX_T_CLOSE:
    if (t->host_closed) return;
    t->host_closed = 1;
    t->linger_deadline_ms = mono_ms() + TUNNEL_LINGER_MS;
    tunnel_pump(t); /* ends it at once when nothing is queued */
    return;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* the other ops */

/* RNDADDENTROPY counts the bytes as entropy (the host draws them from its CRNG), then
 * RNDRESEEDCRNG makes the CRNG use them now: after a snapshot restore every fork must diverge
 * at once (host-facts "Entropy": no vmgenid in this kernel). Host mode only writes the bytes
 * to /dev/urandom (uncredited, harmless): tests must not play with the host's pool. */
static int mix_entropy(const uint8_t *d, size_t n) {
  if (n > SBX_MAX_PAYLOAD) n = SBX_MAX_PAYLOAD;
  int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  int rc = 0;
  if (host_mode) {
    if (n && write(fd, d, n) < 0) rc = -1;
  } else {
    struct {
      int entropy_count;
      int buf_size;
    } *info = malloc(sizeof *info + n);
    if (!info) {
      close(fd);
      return -1;
    }
    info->entropy_count = (int)(n * 8);
    info->buf_size = (int)n;
    memcpy(info + 1, d, n);
    if (ioctl(fd, SBX_RNDADDENTROPY, info) < 0) rc = -1;
    free(info);
    if (rc == 0 && ioctl(fd, SBX_RNDRESEEDCRNG) < 0) rc = -1;
  }
  int saved = errno;
  close(fd);
  errno = saved;
  return rc;
}

/* PATH absolute, or relative to CWD (default "/"). Caller frees. */
static char *resolve_path(const uint8_t *p, size_t n, uint32_t stream) {
  struct tlv t;
  if (!tlv_find(p, n, SBX_TAG_PATH, &t) || t.len == 0) {
    respond_status(stream, EINVAL, "missing PATH");
    return NULL;
  }
  char *path = tlv_strdup(&t);
  if (!path || path[0] == '/') return path;
  char *cwd = tlv_find(p, n, SBX_TAG_CWD, &t) && t.len ? tlv_strdup(&t) : strdup("/");
  char *full = NULL;
  if (cwd && asprintf(&full, "%s/%s", cwd, path) < 0) full = NULL;
  free(cwd);
  free(path);
  return full;
}

/* mkdir -p of the parents of `path` (0755; chowned when the request names an owner). */
static int make_parents(char *path, int have_uid, uint32_t uid, int have_gid, uint32_t gid) {
  for (char *s = path + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    if (mkdir(path, 0755) == 0) {
      if ((have_uid || have_gid) && chown(path, have_uid ? uid : (uid_t)-1, have_gid ? gid : (gid_t)-1) < 0) {
        *s = '/';
        return -1;
      }
    } else if (errno != EEXIST) {
      *s = '/';
      return -1;
    }
    *s = '/';
  }
  return 0;
}

static int write_all(int fd, const uint8_t *d, size_t n) {
  while (n) {
    ssize_t w = write(fd, d, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    d += w;
    n -= (size_t)w;
  }
  return 0;
}

static void op_write_file(uint32_t stream, const uint8_t *p, size_t n) {
  static unsigned counter;
  uint32_t mode = 0644, uid = 0, gid = 0;
  int have_uid = tlv_get_u32(p, n, SBX_TAG_UID, &uid), have_gid = tlv_get_u32(p, n, SBX_TAG_GID, &gid);
  if (tlv_get_u32(p, n, SBX_TAG_MODE, &mode) < 0 || have_uid < 0 || have_gid < 0) {
    respond_status(stream, EINVAL, "write_file: integer field of the wrong width");
    return;
  }
  struct tlv data = {0};
  tlv_find(p, n, SBX_TAG_DATA, &data);
  char *path = resolve_path(p, n, stream), *tmp = NULL;
  if (!path) return;
  char *slash = strrchr(path, '/');
  if (slash[1] == 0) {
    respond_errno(stream, EISDIR, "write_file", path);
    goto out;
  }
  if (make_parents(path, have_uid, uid, have_gid, gid) < 0) {
    respond_errno(stream, errno, "write_file: mkdir parents of", path);
    goto out;
  }
  /* Temp file in the same directory, then rename: readers see the old or the new file, never
   * a half-written one (docs: WRITE_FILE). */
  *slash = 0;
  int r = asprintf(&tmp, "%s/.%s.sbx-tmp-%d-%u", *path ? path : "", slash + 1, (int)getpid(), counter++);
  *slash = '/';
  if (r < 0) {
    tmp = NULL;
    respond_status(stream, ENOMEM, "write_file: out of memory");
    goto out;
  }
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    respond_errno(stream, errno, "write_file: create", tmp);
    goto out;
  }
  int err = 0;
  if (write_all(fd, data.v, data.len) < 0) err = errno;
  /* chown before chmod: chown clears set-id bits. */
  if (!err && (have_uid || have_gid) && fchown(fd, have_uid ? uid : (uid_t)-1, have_gid ? gid : (gid_t)-1) < 0)
    err = errno;
  if (!err && fchmod(fd, mode & 07777) < 0) err = errno;
  if (close(fd) < 0 && !err) err = errno;
  if (!err && rename(tmp, path) < 0) err = errno;
  if (err) {
    unlink(tmp);
    respond_errno(stream, err, "write_file", path);
    goto out;
  }
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  tlv_u64(&b, SBX_TAG_SIZE, data.len);
  send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);
out:
  free(tmp);
  free(path);
}

static void op_read_file(uint32_t stream, const uint8_t *p, size_t n) {
  uint32_t max = READ_FILE_MAX;
  if (tlv_get_u32(p, n, SBX_TAG_MAX_BYTES, &max) < 0) {
    respond_status(stream, EINVAL, "read_file: MAX_BYTES of the wrong width");
    return;
  }
  if (max > READ_FILE_MAX) max = READ_FILE_MAX; /* the DATA must fit one frame */
  char *path = resolve_path(p, n, stream);
  if (!path) return;
  uint8_t *data = NULL;
  /* O_NONBLOCK: a FIFO or a device must not block PID 1's loop; reads stop at EAGAIN. */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    respond_errno(stream, errno, "read_file", path);
    goto out;
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || S_ISDIR(st.st_mode)) {
    int err = errno;
    respond_errno(stream, fstat(fd, &st) == 0 ? EISDIR : err, "read_file", path);
    close(fd);
    goto out;
  }
  /* One byte past the limit tells whether files without a size (procfs) were truncated. */
  data = malloc((size_t)max + 1);
  if (!data) {
    respond_status(stream, ENOMEM, "read_file: out of memory");
    close(fd);
    goto out;
  }
  size_t got = 0;
  while (got < (size_t)max + 1) {
    ssize_t r = read(fd, data + got, (size_t)max + 1 - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno != EAGAIN) {
      respond_errno(stream, errno, "read_file", path);
      close(fd);
      goto out;
    }
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  int truncated = got > max || (S_ISREG(st.st_mode) && (uint64_t)st.st_size > max);
  uint64_t size = S_ISREG(st.st_mode) && (uint64_t)st.st_size > got ? (uint64_t)st.st_size : got;
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  tlv_put(&b, SBX_TAG_DATA, data, got > max ? max : got);
  tlv_u64(&b, SBX_TAG_SIZE, size);
  tlv_u32(&b, SBX_TAG_TRUNCATED, (uint32_t)truncated);
  send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);
out:
  free(data);
  free(path);
}

/*
 * The kernel fixes /proc/sys/kernel/random/boot_id at boot, so every VM restored from one
 * snapshot would report its template's id and programs keying state on it (systemd-style
 * tooling, caches) would take forks for one machine. Each restored VM gets its own: the host
 * sends a fresh UUID, which we write to a file on /dev (devtmpfs: memory only, not part of the
 * image) and bind-mount over the procfs file (procfs entries accept bind mounts). A second call
 * (a fork of a fork) detaches the previous mount first so mounts do not pile up.
 */
static int set_boot_id(const uint8_t *v, size_t len) {
  if (len != 36) {
    errno = EINVAL;
    return -1;
  }
  for (size_t i = 0; i < len; i++) {
    int dash = i == 8 || i == 13 || i == 18 || i == 23;
    char c = (char)v[i];
    if (dash ? c != '-' : !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
      errno = EINVAL;
      return -1;
    }
  }
  const char *target = "/proc/sys/kernel/random/boot_id";
  const char *file = "/dev/.sandboxd-boot_id";
  char tmp[64];
  snprintf(tmp, sizeof tmp, "%s.tmp", file);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444);
  if (fd < 0) return -1;
  char line[40];
  memcpy(line, v, 36);
  line[36] = '\n';
  ssize_t w = write(fd, line, 37);
  close(fd);
  if (w != 37 || rename(tmp, file) < 0) return -1;
  umount2(target, MNT_DETACH); /* EINVAL when nothing is mounted there yet: fine */
  return mount(file, target, NULL, MS_BIND, NULL);
}

static void op_hello(void) {
  char boot_id[64] = "";
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t r = read(fd, boot_id, sizeof boot_id - 1);
    close(fd);
    if (r > 0) {
      boot_id[r] = 0;
      boot_id[strcspn(boot_id, "\n")] = 0;
    }
  }
  struct timespec ts;
  clock_gettime(CLOCK_BOOTTIME, &ts); /* the clock behind /proc/uptime */
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_PROTO_VERSION, SBX_VERSION);
  tlv_str(&b, SBX_TAG_AGENT_VERSION, AGENT_VERSION);
  tlv_str(&b, SBX_TAG_BOOT_ID, boot_id);
  tlv_u64(&b, SBX_TAG_UPTIME_MS, (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000);
  send_buf(SBX_T_HELLO, 0, &b);
  buf_free(&b);
}

static void op_request(uint32_t stream, const uint8_t *p, size_t n) {
  if (stream == 0) {
    logmsg("REQUEST on stream 0 ignored");
    return;
  }
  uint32_t op = 0;
  if (!tlv_valid(p, n) || tlv_get_u32(p, n, SBX_TAG_OP, &op) != 1) {
    respond_status(stream, EINVAL, "malformed request (TLV list or OP)");
    return;
  }
  switch (op) {
  case SBX_OP_PING:
    respond_status(stream, 0, NULL);
    return;
  case SBX_OP_EXEC:
    op_exec(stream, p, n);
    return;
  case SBX_OP_WRITE_FILE:
    op_write_file(stream, p, n);
    return;
  case SBX_OP_READ_FILE:
    op_read_file(stream, p, n);
    return;
  case SBX_OP_ENTROPY: {
    struct tlv t = {0};
    tlv_find(p, n, SBX_TAG_DATA, &t);
    if (mix_entropy(t.v, t.len) < 0)
      respond_errno(stream, errno, "entropy", NULL);
    else
      respond_status(stream, 0, NULL);
    return;
  }
  case SBX_OP_SET_CLOCK: {
    uint64_t ns = 0;
    if (tlv_get_u64(p, n, SBX_TAG_REALTIME_NS, &ns) != 1) {
      respond_status(stream, EINVAL, "set_clock: REALTIME_NS missing");
      return;
    }
    if (host_mode) { /* never set the host's clock from a test */
      respond_status(stream, 0, NULL);
      return;
    }
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
    if (clock_settime(CLOCK_REALTIME, &ts) < 0)
      respond_errno(stream, errno, "set_clock", NULL);
    else
      respond_status(stream, 0, NULL);
    return;
  }
  case SBX_OP_SET_HOSTNAME: {
    struct tlv t;
    if (!tlv_find(p, n, SBX_TAG_HOSTNAME, &t)) {
      respond_status(stream, EINVAL, "set_hostname: HOSTNAME missing");
      return;
    }
    if (host_mode) { /* never rename the host from a test */
      respond_status(stream, t.len > 64 ? EINVAL : 0, t.len > 64 ? "set_hostname: too long" : NULL);
      return;
    }
    if (sethostname((const char *)t.v, t.len) < 0) {
      respond_errno(stream, errno, "set_hostname", NULL);
      return;
    }
    struct tlv bid;
    if (tlv_find(p, n, SBX_TAG_BOOT_ID, &bid) && set_boot_id(bid.v, bid.len) < 0) {
      respond_errno(stream, errno, "set_hostname: boot id", NULL);
      return;
    }
    respond_status(stream, 0, NULL);
    return;
  }
  case SBX_OP_CONNECT:
    op_connect(stream, p, n);
    return;
  case SBX_OP_SYNC:
    sync();
    respond_status(stream, 0, NULL);
    return;
  default:
    respond_status(stream, ENOSYS, "unknown op");
    return;
  }
}

static void dispatch(uint8_t type, uint32_t stream, const uint8_t *p, size_t n) {
  struct exec *e;
  switch (type) {
  case SBX_T_HELLO:
    /* A HELLO starts the host afresh: tunnels it knew are gone on its side (docs "Tunnels"). */
    tunnels_close_all("host said HELLO");
    op_hello();
    return;
  case SBX_T_REQUEST:
    op_request(stream, p, n);
    return;
  case SBX_T_STDIN:
    e = find_exec(stream);
    if (!e || !e->stream_stdin || e->in_fd < 0) return; /* late or unknown: drop */
    if (n == 0)
      e->in_eof = 1;
    else
      stdin_push(e, p, n);
    stdin_pump(e);
    return;
  case SBX_T_CANCEL:
    e = find_exec(stream);
    if (e && !e->exited) {
      e->cancelled = 1;
      kill_group(e);
    }
    return;
  case SBX_T_DATA:
  case SBX_T_CLOSE:
  case SBX_T_CREDIT:
    tunnel_frame(type, stream, p, n);
    return;
  default:
    logmsg("unknown frame type %u on stream %u ignored", type, stream);
    return;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* incremental frame decoder (host -> guest) */

static uint8_t hdr[SBX_HEADER_LEN];
static size_t hdr_len;
static uint8_t frame_payload[SBX_MAX_PAYLOAD]; /* one frame at a time; static: no allocation */
static size_t pay_len, pay_need;
static int in_payload;
/* After a malformed header we skip input until something that looks like a HELLO header:
 * the host sends HELLO to resynchronise (docs "Framing"). */
static int resync;

static void decoder_reset(void) {
  hdr_len = 0;
  pay_len = pay_need = 0;
  in_payload = 0;
  resync = 0;
}

/* Whether the first n bytes can start a valid header (in resync: a HELLO header). */
static int hdr_prefix_ok(const uint8_t *h, size_t n, int want_hello) {
  if (n > 0 && h[0] != (SBX_MAGIC & 0xff)) return 0;
  if (n > 1 && h[1] != (SBX_MAGIC >> 8)) return 0;
  if (n > 2 && h[2] != SBX_VERSION) return 0;
  if (want_hello) {
    if (n > 3 && h[3] != SBX_T_HELLO) return 0;
    for (size_t i = 4; i < 8 && i < n; i++)
      if (h[i]) return 0;
  }
  if (n >= SBX_HEADER_LEN && get32(h + 8) > SBX_MAX_PAYLOAD) return 0;
  return 1;
}

static void feed(const uint8_t *p, size_t n) {
  while (n > 0 && connected) { /* a dispatch may lose the host: stop feeding then */
    if (!in_payload) {
      hdr[hdr_len++] = *p++;
      n--;
      if (!hdr_prefix_ok(hdr, hdr_len, resync)) {
        if (!resync) {
          logmsg("malformed frame header (magic/version/length), dropping input until HELLO");
          resync = 1;
        }
        size_t k = 1;
        while (k < hdr_len && !hdr_prefix_ok(hdr + k, hdr_len - k, 1)) k++;
        memmove(hdr, hdr + k, hdr_len - k);
        hdr_len -= k;
        continue;
      }
      if (hdr_len == SBX_HEADER_LEN) {
        uint8_t type = hdr[3];
        uint32_t stream = get32(hdr + 4);
        pay_need = get32(hdr + 8);
        pay_len = 0;
        hdr_len = 0;
        if (type == SBX_T_HELLO) resync = 0;
        if (pay_need == 0) {
          dispatch(type, stream, frame_payload, 0);
        } else {
          in_payload = 1;
          hdr[3] = type; /* keep type/stream for when the payload completes */
          put32(hdr + 4, stream);
        }
      }
      continue;
    }
    size_t take = pay_need - pay_len;
    if (take > n) take = n;
    memcpy(frame_payload + pay_len, p, take);
    pay_len += take;
    p += take;
    n -= take;
    if (pay_len == pay_need) {
      in_payload = 0;
      dispatch(hdr[3], get32(hdr + 4), frame_payload, pay_len);
    }
  }
}

static void port_readable(void) {
  static uint8_t rbuf[65536];
  /* At most 16 reads per wakeup so a flood of input cannot starve the execs' pipes. */
  for (int i = 0; i < 16 && connected; i++) {
    ssize_t n = read(port_fd, rbuf, sizeof rbuf);
    if (n > 0) {
      feed(rbuf, (size_t)n);
      continue;
    }
    if (n == 0) {
      host_lost("EOF", 0);
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) return;
    host_lost("read", errno);
    return;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* PID 1 boot */

static void mount_logged(const char *src, const char *dst, const char *type, unsigned long flags, const char *data) {
  mkdir(dst, 0755);
  if (mount(src, dst, type, flags, data) < 0 && errno != EBUSY)
    logmsg("mount %s on %s: %s", type ? type : src, dst, strerror(errno));
}

/* The kernel hands init fds 0-2 on /dev/console only when the initramfs has that node; make sure
 * 0-2 are occupied so no pipe ever lands there (dup2 in the child would then clobber it). */
static void ensure_std_fds(void) {
  for (int fd = 0; fd < 3; fd++) {
    if (fcntl(fd, F_GETFD) >= 0) continue;
    int n = open("/dev/null", O_RDWR);
    if (n < 0) n = open("/", O_RDONLY);
    if (n >= 0 && n != fd) {
      dup2(n, fd);
      close(n);
    }
  }
}

static char cmd_hostname[65];
static char cmd_root[128] = "/dev/vda";

static void parse_cmdline(void) {
  char buf[4096];
  int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return;
  buf[n] = 0;
  for (char *save = NULL, *tok = strtok_r(buf, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
    if (strncmp(tok, "sandboxd.hostname=", 18) == 0) snprintf(cmd_hostname, sizeof cmd_hostname, "%s", tok + 18);
    /* sandboxd.root=none keeps the initramfs as root (diagnostics, tests of the initramfs). */
    if (strncmp(tok, "sandboxd.root=", 14) == 0) snprintf(cmd_root, sizeof cmd_root, "%s", tok + 14);
  }
}

static int ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* /etc/modules.order: one module per line, in dependency order (the initramfs builder writes
 * it). A line is an absolute path, a path relative to /lib/modules, or a bare file name. */
static void load_modules(void) {
  FILE *f = fopen("/etc/modules.order", "re");
  if (!f) {
    logmsg("no /etc/modules.order: no modules loaded");
    return;
  }
  char line[512];
  int loaded = 0;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\r\n")] = 0;
    char *s = line;
    while (*s == ' ' || *s == '\t') s++;
    if (!*s || *s == '#') continue;
    const char *base = strrchr(s, '/') ? strrchr(s, '/') + 1 : s;
    char cand[3][600];
    snprintf(cand[0], sizeof cand[0], "%s%s", s[0] == '/' ? "" : "/lib/modules/", s);
    snprintf(cand[1], sizeof cand[1], "/lib/modules/%s", base);
    snprintf(cand[2], sizeof cand[2], "/%s", s);
    int fd = -1;
    for (int i = 0; i < 3 && fd < 0; i++) fd = open(cand[i], O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      logmsg("module %s: not found", s);
      continue;
    }
    int flags = ends_with(s, ".xz") || ends_with(s, ".zst") || ends_with(s, ".gz") ? SBX_MODULE_INIT_COMPRESSED_FILE : 0;
    if (syscall(SYS_finit_module, fd, "", flags) < 0 && errno != EEXIST)
      logmsg("module %s: finit_module: %s", s, strerror(errno));
    else
      loaded++;
    close(fd);
  }
  fclose(f);
  logmsg("%d modules loaded", loaded);
}

/* Recursively delete the initramfs (its pages are RAM that nothing needs after the switch),
 * staying on its own filesystem: /newroot and anything mounted is skipped by st_dev. */
static void rm_tree(int dfd, dev_t dev) {
  DIR *d = fdopendir(dfd);
  if (!d) {
    close(dfd);
    return;
  }
  struct dirent *de;
  while ((de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    struct stat st;
    if (fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 || st.st_dev != dev) continue;
    if (S_ISDIR(st.st_mode)) {
      int sub = openat(dfd, de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub >= 0) rm_tree(sub, dev);
      unlinkat(dfd, de->d_name, AT_REMOVEDIR);
    } else {
      unlinkat(dfd, de->d_name, 0);
    }
  }
  closedir(d);
}

static int has_virtio_block(void) {
  /* A virtio device of type 2 (block) declared on the bus: then a /dev/vda will come. */
  DIR *d = opendir("/sys/bus/virtio/devices");
  if (!d) return 0;
  struct dirent *de;
  int found = 0;
  while (!found && (de = readdir(d))) {
    if (de->d_name[0] == '.') continue;
    char p[512], v[32] = "";
    snprintf(p, sizeof p, "/sys/bus/virtio/devices/%s/device", de->d_name);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ssize_t r = read(fd, v, sizeof v - 1);
    close(fd);
    if (r > 0 && strtoul(v, NULL, 0) == 2) found = 1;
  }
  closedir(d);
  return found;
}

/* Mount the image disk and make it / the way a container runtime would. */
static void switch_root(void) {
  if (strcmp(cmd_root, "none") == 0) return;
  mkdir("/newroot", 0755);
  if (mount(cmd_root, "/newroot", "ext4", 0, NULL) < 0) {
    logmsg("mount %s on /newroot: %s; staying in the initramfs", cmd_root, strerror(errno));
    return;
  }
  /* Move the kernel filesystems into the new root (the image has empty dirs for them; made if
   * missing). The image's /tmp and /run stay as they are on its disk, as in a container image. */
  static const char *const moves[] = {"/dev", "/proc", "/sys"};
  for (size_t i = 0; i < 3; i++) {
    char dst[64];
    snprintf(dst, sizeof dst, "/newroot%s", moves[i]);
    mkdir(dst, 0755);
    if (mount(moves[i], dst, NULL, MS_MOVE, NULL) < 0) logmsg("move %s: %s", moves[i], strerror(errno));
  }
  mount_logged("devpts", "/newroot/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
  mount_logged("shm", "/newroot/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
  /* devtmpfs lacks the /proc/self/fd links a runtime adds (bash process substitution needs them). */
  static const char *const links[][2] = {
      {"/proc/self/fd", "/newroot/dev/fd"},
      {"/proc/self/fd/0", "/newroot/dev/stdin"},
      {"/proc/self/fd/1", "/newroot/dev/stdout"},
      {"/proc/self/fd/2", "/newroot/dev/stderr"},
  };
  for (size_t i = 0; i < 4; i++) {
    if (symlink(links[i][0], links[i][1]) < 0 && errno != EEXIST) logmsg("symlink %s: %s", links[i][1], strerror(errno));
  }
  if (chdir("/newroot") < 0) {
    logmsg("chdir /newroot: %s", strerror(errno));
    return;
  }
  struct statfs sf;
  if (statfs("/", &sf) == 0 && ((uint32_t)sf.f_type == SBX_RAMFS_MAGIC || (uint32_t)sf.f_type == SBX_TMPFS_MAGIC)) {
    struct stat st;
    int rfd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rfd >= 0 && fstat(rfd, &st) == 0)
      rm_tree(rfd, st.st_dev);
    else if (rfd >= 0)
      close(rfd);
  }
  /* switch_root: the new root replaces / in our mount namespace; chroot so that "/" of every
   * process we fork is the image. */
  if (mount(".", "/", NULL, MS_MOVE, NULL) < 0) {
    logmsg("move /newroot to /: %s", strerror(errno));
    return;
  }
  if (chroot(".") < 0) logmsg("chroot: %s", strerror(errno));
  if (chdir("/") < 0) logmsg("chdir /: %s", strerror(errno));
  logmsg("switched root to %s", cmd_root);
}

static void loopback_up(void) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return;
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
  /* Bringing lo up makes the kernel add 127.0.0.1/8 and ::1 itself. */
  if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0 || (ifr.ifr_flags |= IFF_UP | IFF_RUNNING, ioctl(s, SIOCSIFFLAGS, &ifr) < 0))
    logmsg("lo up: %s", strerror(errno));
  close(s);
}

/* First thing as PID 1, before any fd is opened: the kernel filesystems and fds 0-2. */
static void early_boot(void) {
  mount_logged("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
  ensure_std_fds();
  console_fd = open("/dev/console", O_WRONLY | O_NOCTTY | O_CLOEXEC);
  mount_logged("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
  mount_logged("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

static void boot(void) {
  parse_cmdline();
  load_modules();
  /* Wait (bounded, BOOT_WAIT_MS) for the root disk and the agent port; both appear
   * asynchronously once their modules probe. */
  int64_t until = mono_ms() + BOOT_WAIT_MS;
  int want_root = strcmp(cmd_root, "none") != 0;
  for (;;) {
    struct stat st;
    int root_ok = !want_root || stat(cmd_root, &st) == 0;
    if (port_fd < 0) open_agent_port(1);
    if (root_ok && port_fd >= 0) break;
    /* No virtio block device declared at all: do not wait for one that will never come. */
    if (!root_ok && !has_virtio_block() && mono_ms() > until - BOOT_WAIT_MS + 500) want_root = 0;
    if (mono_ms() >= until) {
      if (!root_ok) logmsg("%s did not appear within %d ms", cmd_root, BOOT_WAIT_MS);
      if (port_fd < 0) logmsg("agent port did not appear within %d ms; still looking", BOOT_WAIT_MS);
      break;
    }
    usleep(BOOT_POLL_MS * 1000);
  }
  switch_root();
  if (cmd_hostname[0] && sethostname(cmd_hostname, strlen(cmd_hostname)) < 0)
    logmsg("sethostname %s: %s", cmd_hostname, strerror(errno));
  loopback_up();
  struct timespec ts;
  clock_gettime(CLOCK_BOOTTIME, &ts);
  logmsg("ready %ld ms after kernel start", (long)(ts.tv_sec * 1000 + ts.tv_nsec / 1000000));
}

/* ------------------------------------------------------------------------------------------ */
/* the loop */

enum { K_SIG, K_PORT, K_EGRESS, K_IN, K_OUT, K_ERR, K_DETACHED, K_TUN };

static void reap(int sigfd) {
  struct signalfd_siginfo si;
  while (sigfd >= 0 && read(sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
  }
  /* signalfd coalesces SIGCHLDs: reap everything that is dead. Orphans of every exec reparent
   * to us (PID 1, or subreaper in host mode); __WALL also reaps clone() children whose exit
   * signal is not SIGCHLD. */
  for (;;) {
    int st;
    pid_t pid = waitpid(-1, &st, WNOHANG | __WALL);
    if (pid <= 0) break;
    for (struct exec *e = execs; e; e = e->next)
      if (e->pid == pid && !e->exited) {
        e->exited = 1;
        e->status = st;
        e->end_us = mono_us();
        break;
      }
  }
}

static void timers(void) {
  int64_t now = mono_ms();
  if (!connected && now >= next_probe_ms) probe_host();
  for (struct exec *e = execs; e; e = e->next)
    if (!e->exited && e->deadline_ms && now >= e->deadline_ms) {
      e->timed_out = 1;
      e->deadline_ms = 0;
      kill_group(e);
    }
  for (struct tunnel *t = tunnels; t; t = t->next) {
    if (t->dead) continue;
    if (t->connecting && now >= t->connect_deadline_ms)
      tunnel_connected(t, 1);
    else if (t->host_closed && now >= t->linger_deadline_ms)
      tunnel_end(t, 1, 0, NULL); /* the guest reader never drained: give up on the rest */
  }
}

/* Answer execs whose pid exited and whose pipes reached EOF or whose drain expired. */
static void complete_execs(void) {
  int64_t now = mono_ms();
  struct exec **pp = &execs;
  while (*pp) {
    struct exec *e = *pp;
    if (e->exited) {
      if (!e->draining) {
        e->draining = 1;
        e->drain_deadline_ms = now + DRAIN_MS;
        exec_read(e, 1, READ_PASS_MAX);
        exec_read(e, 2, READ_PASS_MAX);
      }
      if ((e->out_fd < 0 && e->err_fd < 0) || now >= e->drain_deadline_ms) {
        *pp = e->next;
        exec_finish(e);
        continue;
      }
    }
    pp = &e->next;
  }
}

static int sigfd_missing;

static int poll_timeout(void) {
  int64_t now = mono_ms(), next = INT64_MAX;
  if (!connected) next = next_probe_ms;
  for (struct exec *e = execs; e; e = e->next) {
    if (!e->exited && e->deadline_ms && e->deadline_ms < next) next = e->deadline_ms;
    if (e->exited && e->draining && e->drain_deadline_ms < next) next = e->drain_deadline_ms;
  }
  for (struct tunnel *t = tunnels; t; t = t->next) {
    if (t->dead) continue;
    if (t->connecting && t->connect_deadline_ms < next) next = t->connect_deadline_ms;
    if (t->host_closed && t->linger_deadline_ms < next) next = t->linger_deadline_ms;
  }
  if (next == INT64_MAX) return sigfd_missing ? 100 : -1;
  if (next <= now) return 0;
  return next - now > 60000 ? 60000 : (int)(next - now);
}

static void loop(int sigfd) {
  struct pollfd *pfd = NULL;
  struct {
    int kind;
    struct exec *e;
    struct tunnel *t;
  } *ref = NULL;
  size_t cap = 0;
  for (;;) { /* PID 1: forever */
    if (sigfd < 0) reap(sigfd); /* no signalfd (should not happen): reap by polling */
    timers();
    complete_execs();
    tunnels_sweep(); /* frees tunnels ended during the last pass, before the poll set is rebuilt */

    size_t need = 3 + 3 * (size_t)n_execs + (size_t)n_detached + (size_t)n_tunnel_slots, k = 0;
    if (need > cap) {
      struct pollfd *np = realloc(pfd, need * sizeof *pfd);
      if (np) pfd = np;
      void *nr = realloc(ref, need * sizeof *ref);
      if (nr) ref = nr;
      if (!np || !nr) {
        logmsg("out of memory for the poll set");
        usleep(100000); /* let memory pressure pass rather than spin */
        continue;
      }
      cap = need;
    }
#define ADD(fd_, ev_, kind_, e_)                                                                     \
  (pfd[k].fd = (fd_), pfd[k].events = (ev_), pfd[k].revents = 0, ref[k].kind = (kind_), ref[k].e = (e_), \
   ref[k].t = NULL, k++)
    ADD(sigfd, POLLIN, K_SIG, NULL);
    if (connected) ADD(port_fd, POLLIN | (outq_head ? POLLOUT : 0), K_PORT, NULL);
    if (egress_fd >= 0) ADD(egress_fd, POLLIN, K_EGRESS, NULL);
    int backpressure = connected && outq_bytes > OUTQ_STREAM_HIGH;
    for (struct exec *e = execs; e; e = e->next) {
      if (e->in_fd >= 0 && e->in_head) ADD(e->in_fd, POLLOUT, K_IN, e);
      int paused = backpressure && e->stream_output;
      if (e->out_fd >= 0 && !paused) ADD(e->out_fd, POLLIN, K_OUT, e);
      if (e->err_fd >= 0 && !paused) ADD(e->err_fd, POLLIN, K_ERR, e);
    }
    for (int i = 0; i < n_detached; i++) ADD(detached[i], POLLIN, K_DETACHED, NULL);
    for (struct tunnel *t = tunnels; t; t = t->next) {
      if (t->dead) continue;
      /* Read only with credit, and not while the port's queue is over its high mark: both are
       * the back-pressure that keeps PID 1's memory bounded. With nothing to wait for, the fd
       * stays out of the set (a POLLHUP there would only spin); it is looked at again when
       * credit comes or the host sends data. */
      short ev = t->connecting ? POLLOUT
                               : (short)((t->send_credit > 0 && !t->host_closed && !backpressure ? POLLIN : 0) |
                                         (t->in_head ? POLLOUT : 0));
      if (!ev) continue;
      ADD(t->fd, ev, K_TUN, NULL);
      ref[k - 1].t = t;
    }
#undef ADD

    int r = poll(pfd, k, poll_timeout());
    if (r < 0) {
      if (errno != EINTR) {
        logmsg("poll: %s", strerror(errno));
        usleep(10000); /* never spin on a persistent error */
      }
      continue;
    }
    /* Execs are only freed in complete_execs, so ref[].e stays valid during this pass. */
    for (size_t i = 0; i < k; i++) {
      short re = pfd[i].revents;
      if (!re) continue;
      struct exec *e = ref[i].e;
      switch (ref[i].kind) {
      case K_SIG:
        reap(sigfd);
        break;
      case K_PORT:
        if (!connected || pfd[i].fd != port_fd) break;
        if (re & (POLLIN | POLLHUP | POLLERR)) port_readable();
        if (connected && (re & POLLOUT)) flush_out();
        break;
      case K_EGRESS:
        egress_accept();
        break;
      case K_IN:
        if (e->in_fd == pfd[i].fd) stdin_pump(e);
        break;
      case K_OUT:
        if (e->out_fd == pfd[i].fd) exec_read(e, 1, READ_PASS_MAX);
        break;
      case K_ERR:
        if (e->err_fd == pfd[i].fd) exec_read(e, 2, READ_PASS_MAX);
        break;
      case K_TUN: {
        struct tunnel *t = ref[i].t;
        if (t->dead || t->fd != pfd[i].fd) break; /* ended earlier in this pass */
        if (t->connecting) {
          tunnel_connected(t, 0);
          break;
        }
        if (re & POLLOUT) tunnel_pump(t);
        if (!t->dead && (re & (POLLIN | POLLHUP | POLLERR))) {
          if (t->send_credit > 0 && !t->host_closed)
            tunnel_read(t); /* reads the data, the EOF or the error */
          else if (!t->in_head || (re & POLLERR))
            tunnel_pump(t); /* a write error ends it; an empty queue waits for credit */
        }
        break;
      }
      case K_DETACHED: {
        ssize_t n = read(pfd[i].fd, scratch, sizeof scratch);
        if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) break;
        close(pfd[i].fd); /* EOF: the last background writer is gone */
        for (int j = 0; j < n_detached; j++)
          if (detached[j] == pfd[i].fd) {
            detached[j] = detached[--n_detached];
            break;
          }
        break;
      }
      }
    }
  }
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--port") == 0 && i + 1 < argc)
      port_path = argv[++i];
    else if (strcmp(argv[i], "--egress-port") == 0 && i + 1 < argc)
      test_egress_port = (uint32_t)strtoul(argv[++i], NULL, 10);
    else if (getpid() != 1) {
      fprintf(stderr, "usage: %s --port UNIX_SOCKET_PATH [--egress-port N]   (host test mode; as PID 1 no arguments)\n", argv[0]);
      return 2;
    }
  }
  host_mode = getpid() != 1 || port_path != NULL;
  if (host_mode && !port_path) {
    fprintf(stderr, "%s: not PID 1: host test mode needs --port UNIX_SOCKET_PATH\n", argv[0]);
    return 2;
  }
  if (!host_mode)
    early_boot();
  else
    ensure_std_fds(); /* a pipe must never land on fd 0-2 (see ensure_std_fds) */
  umask(022);
  /* SIGPIPE: a write to a closed pipe or socket must be an EPIPE, not our death. */
  signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  sigprocmask(SIG_BLOCK, &mask, NULL);
  int sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
  if (sigfd < 0) {
    logmsg("signalfd: %s", strerror(errno));
    if (host_mode) return 1;
    sigfd_missing = 1;
  }
  if (host_mode) {
    console_fd = fcntl(2, F_DUPFD_CLOEXEC, 3);
    /* Orphans of our execs reparent to us, as they would to PID 1 in the guest. */
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    logmsg("host test mode, port %s", port_path);
  } else {
    boot();
  }
  if (!host_mode)
    egress_listen(SBX_EGRESS_PORT); /* after boot: lo is up */
  else if (test_egress_port)
    egress_listen(test_egress_port);
  loop(sigfd);
  return 0; /* not reached */
}
